"""The package's layers, read from its source (issue 18): no process group, no torch needed.

Imports run one way, up the layers below: a module imports only modules of its own layer or
of the layers under it. Every import statement counts, also those inside functions or under
``TYPE_CHECKING``. No module is over 600 lines and at most five functions are over 60 (the
long ones are listed, so the list only shrinks: remove an entry once it is split).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fullshard"

BASE = {"fullshard.api", "fullshard._switches"}
"""Public enums and configuration dataclasses, and the environment switches, importing nothing
of fullshard: any layer may use them."""
COMM = {"fullshard._comm"}
"""The transport: collectives, the shared-memory rings, process groups."""
ENGINE = {"fullshard._engine"}
"""Units: settings, construction, the flat parameter, the runtime's hooks."""
FEATURES = {"fullshard._features"}
"""State dicts, optimizer state dicts, summon, gradient clipping: they take units."""
COMMAND_LINE = {
    "fullshard.__main__",
    "fullshard.cli",
    "fullshard.memory",
    "fullshard.examples",
}
"""The command-line programs (the ``fullshard.cli`` package and its modules) and what only
they use (the memory model, the example models)."""
LAYERS = [("base", BASE), ("comm", COMM), ("engine", ENGINE), ("features", FEATURES)]
"""From the bottom; the front doors (every other module: ``fully_sharded_data_parallel``,
``wrap``, ``checkpoint``, ...) come next, the command-line programs last."""

MAX_LINES = 600
MAX_FUNCTION_LINES = 60
MAX_LONG_FUNCTIONS = 5
REMAINING_LONG_FUNCTIONS = {
    ("fullshard/_auto_wrap.py", "auto_wrap"),
    ("fullshard/_features/state_dict.py", "load_pre_hook"),
    ("fullshard/fully_sharded_data_parallel.py", "__init__"),
}
"""The functions over ``MAX_FUNCTION_LINES`` (at most ``MAX_LONG_FUNCTIONS``)."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The fullshard modules ``module`` imports (a package where a name is not a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("fullshard"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module.split(".")
                if path.name != "__init__.py":
                    package = package[:-1]
                package = package[: len(package) - node.level + 1]
                target = ".".join(package + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("fullshard"):
                continue
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                found.add(candidate if candidate in known else target)
    return {name for name in found if name in known and name != module}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imported(name, path, known) for name, path in modules.items()}


def _in(module: str, group: set[str] | str) -> bool:
    names = {group} if isinstance(group, str) else group
    return any(module == name or module.startswith(name + ".") for name in names)


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _layer(module: str) -> tuple[int, str]:
    for rank, (name, members) in enumerate(LAYERS):
        if _in(module, members):
            return rank, name
    if _in(module, COMMAND_LINE):
        return len(LAYERS) + 1, "command line"
    return len(LAYERS), "front doors"


def test_every_import_runs_down_the_layers() -> None:
    """No module imports one of a layer above its own: the transport builds on torch alone,
    the engine never imports the FSDP1 wrapper or the features, nothing below the
    command-line programs imports them."""
    graph = _graph()
    upward = sorted(
        f"{module} ({_layer(module)[1]}) imports {target} ({_layer(target)[1]})"
        for module, targets in graph.items()
        for target in targets
        if _layer(target)[0] > _layer(module)[0]
    )
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_the_layers_are_assigned_as_documented() -> None:
    """The rule above would pass vacuously if a layer's name matched nothing."""
    modules = set(_modules())
    for name, members in [*LAYERS, ("command line", COMMAND_LINE)]:
        for member in members:
            assert any(_in(module, member) for module in modules), f"{name}: no {member}"
    assert _layer("fullshard._engine.runtime")[1] == "engine"
    assert _layer("fullshard.fully_sharded_data_parallel")[1] == "front doors"
    assert _layer("fullshard.cli.train")[1] == "command line"


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles: {[sorted(cycle) for cycle in cycles]}"


def test_the_cycle_finder_finds_a_cycle() -> None:
    """A cycle through three modules, and one self-contained module, on a made-up graph."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [{"a", "b", "c"}]


def test_module_and_function_sizes() -> None:
    """No module over 600 lines; at most five functions over 60 (the listed ones)."""
    large: dict[str, int] = {}
    long_functions: set[tuple[str, str]] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = str(path.relative_to(PACKAGE.parent))
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > MAX_LINES:
            large[relative] = lines
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    long_functions.add((relative, node.name))
    assert not large, f"modules over {MAX_LINES} lines: {large}"
    new = long_functions - REMAINING_LONG_FUNCTIONS
    assert not new, f"functions over {MAX_FUNCTION_LINES} lines: {sorted(new)}"
    gone = REMAINING_LONG_FUNCTIONS - long_functions
    assert not gone, f"no longer over {MAX_FUNCTION_LINES} lines (remove them): {sorted(gone)}"
    assert len(REMAINING_LONG_FUNCTIONS) <= MAX_LONG_FUNCTIONS
