"""Tests for fullshard.wrap: the chosen targets must match torch's own FSDP wrapping."""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.fsdp.wrap as torch_wrap
from torch import nn

import fullshard.wrap as fs_wrap
from fullshard.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _Policy,
    enable_wrap,
    resolve_policy,
    wrap,
)

# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


class ToyTransformer(nn.Module):
    """Embedding, two encoder layers in a ModuleList, and an output head."""

    def __init__(self, tie_weights: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(
            [nn.TransformerEncoderLayer(8, 2, 16, batch_first=True) for _ in range(2)]
        )
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16)
        if tie_weights:
            self.head.weight = self.embed.weight


class ListModel(nn.Module):
    """Blocks in a ModuleList, each block a Sequential, plus a parameter on the root."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)) for _ in range(3)]
        )


class SharedModuleModel(nn.Module):
    """One Linear registered under two parents."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(6, 6)
        self.first = nn.Sequential(shared, nn.Linear(6, 6))
        self.second = nn.Sequential(nn.Linear(6, 3), shared)


def nested_sequential() -> nn.Sequential:
    """Sequential of Linears with a nested Sequential."""
    return nn.Sequential(
        nn.Linear(4, 8),
        nn.ReLU(),
        nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8)), nn.Linear(8, 2)),
    )


MODELS: dict[str, Callable[[], nn.Module]] = {
    "sequential": nested_sequential,
    "transformer": ToyTransformer,
    "tied_transformer": functools.partial(ToyTransformer, tie_weights=True),
    "module_list": ListModel,
    "shared_module": SharedModuleModel,
}


def is_linear(module: nn.Module) -> bool:
    """Predicate for the lambda policies."""
    return isinstance(module, nn.Linear)


# (policy function name, kwargs): built from both torch's module and ours.
CALLABLE_POLICIES: dict[str, tuple[str, dict[str, Any]]] = {
    "always": ("always_wrap_policy", {}),
    "lambda_linear": ("lambda_auto_wrap_policy", {"lambda_fn": is_linear}),
    "transformer_layer": (
        "transformer_auto_wrap_policy",
        {"transformer_layer_cls": {nn.TransformerEncoderLayer, nn.Sequential}},
    ),
    "size_1": ("size_based_auto_wrap_policy", {"min_num_params": 1}),
    "size_40": ("size_based_auto_wrap_policy", {"min_num_params": 40}),
    "size_100": ("size_based_auto_wrap_policy", {"min_num_params": 100}),
    "size_300": ("size_based_auto_wrap_policy", {"min_num_params": 300}),
    "size_no_leaf": (
        "size_based_auto_wrap_policy",
        {"min_num_params": 20, "force_leaf_modules": set(), "exclude_wrap_modules": set()},
    ),
}

MODULE_CLASS_SETS: dict[str, set[type[nn.Module]]] = {
    "linear": {nn.Linear},
    "encoder_layer": {nn.TransformerEncoderLayer},
    "sequential": {nn.Sequential},
    "root_class": {ToyTransformer, ListModel, SharedModuleModel, nn.Linear},
    "empty": set(),
}

# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def dedup(modules: list[nn.Module]) -> list[nn.Module]:
    """Keep the first occurrence of each module (torch walks shared modules twice)."""
    return list(dict.fromkeys(modules))


def expand_ignored(ignored_roots: set[nn.Module]) -> set[nn.Module]:
    """Ignored modules with their subtrees, as torch's FSDP passes them to the policy."""
    return {sub for module in ignored_roots for sub in module.modules()}


def torch_recursive_targets(
    root: nn.Module, policy: Callable[..., bool], ignored_roots: set[nn.Module] | None = None
) -> list[nn.Module]:
    """Modules torch's `_recursive_wrap` wraps, in call order, recorded without wrapping."""
    ignored = expand_ignored(ignored_roots or set())
    recorded: list[nn.Module] = []

    def record(module: nn.Module, **kwargs: Any) -> nn.Module:
        recorded.append(module)
        return module

    torch_wrap._recursive_wrap(
        root,
        policy,
        wrapper_cls=record,
        ignored_modules=ignored,
        ignored_params={p for m in ignored for p in m.parameters()},
        only_wrap_children=True,
    )
    return dedup(recorded)


def our_targets(
    root: nn.Module, policy: Any, ignored: set[nn.Module] | None = None
) -> list[nn.Module]:
    """Targets of fullshard's policy, in the returned (post-)order."""
    resolved = resolve_policy(policy)
    assert resolved is not None
    return list(resolved._run_policy(root, ignored or set(), {}))


def assert_post_order(targets: list[nn.Module]) -> None:
    """No target is listed before one of its descendants."""
    for i, module in enumerate(targets):
        descendants = set(module.modules()) - {module}
        assert not descendants & set(targets[i + 1 :]), f"{type(module).__name__} too early"


def both_callable_policies(key: str) -> tuple[Callable[..., bool], Callable[..., bool]]:
    """(torch's policy, ours) for a CALLABLE_POLICIES key."""
    name, kwargs = CALLABLE_POLICIES[key]
    return (
        functools.partial(getattr(torch_wrap, name), **kwargs),
        functools.partial(getattr(fs_wrap, name), **kwargs),
    )


# ---------------------------------------------------------------------------
# Legacy callable policies against torch's _recursive_wrap
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy_key", sorted(CALLABLE_POLICIES))
@pytest.mark.parametrize("model_key", sorted(MODELS))
def test_callable_policy_targets_match_torch(model_key: str, policy_key: str) -> None:
    """Legacy callable policies pick the same modules, in the same order, as torch."""
    model = MODELS[model_key]()
    torch_policy, our_policy = both_callable_policies(policy_key)
    expected = torch_recursive_targets(model, torch_policy)
    actual = our_targets(model, our_policy)
    assert actual == expected
    assert model not in actual
    assert_post_order(actual)


def test_callable_policy_cases_nontrivial_when_compared() -> None:
    """The comparison matrix covers both empty and non-empty target sets."""
    sizes = {
        len(our_targets(MODELS[m](), both_callable_policies(p)[1]))
        for m in MODELS
        for p in CALLABLE_POLICIES
    }
    assert 0 in sizes and max(sizes) >= 5


def test_size_policy_skips_descent_when_module_small() -> None:
    """A module below the threshold is neither descended into nor wrapped."""
    model = nested_sequential()
    policy = functools.partial(fs_wrap.size_based_auto_wrap_policy, min_num_params=100)
    # model[2] holds 72 + 72 + 18 = 162 numel: descended; its Linears (72, 18) are too small.
    assert our_targets(model, policy) == [model[2]]


def test_size_policy_never_wraps_excluded_when_module_list() -> None:
    """ModuleList is descended into but never wrapped, with the default exclusions."""
    model = ListModel()
    policy = functools.partial(fs_wrap.size_based_auto_wrap_policy, min_num_params=1)
    targets = our_targets(model, policy)
    # Each block's Linears are wrapped, leaving the block itself 0 numel: not wrapped.
    block = model.get_submodule("blocks.0")
    assert model.blocks not in targets and block not in targets
    assert block.get_submodule("0") in targets and block.get_submodule("2") in targets


def test_size_policy_keeps_leaf_when_multihead_attention() -> None:
    """MultiheadAttention is neither descended into nor wrapped (as in torch, a module not
    descended into is never wrapped), with the default force-leaf set."""
    model = ToyTransformer()
    policy = functools.partial(fs_wrap.size_based_auto_wrap_policy, min_num_params=1)
    targets = our_targets(model, policy)
    attn = model.get_submodule("layers.0.self_attn")
    assert attn not in targets and attn.get_submodule("out_proj") not in targets
    assert model.get_submodule("layers.0") in targets
    assert model.get_submodule("layers.0.linear1") in targets


def test_size_policy_class_attributes_when_read() -> None:
    """The default class sets are exposed as function attributes, equal to torch's."""
    ours = fs_wrap.size_based_auto_wrap_policy
    theirs = torch_wrap.size_based_auto_wrap_policy
    assert ours.FORCE_LEAF_MODULES == theirs.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
    assert ours.EXCLUDE_WRAP_MODULES == theirs.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]


class TiedBlock(nn.Module):
    """Two Linears sharing one 10x10 weight, plus a 60-numel parameter of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Parameter(torch.zeros(60))
        self.a = nn.Linear(10, 10, bias=False)
        self.b = nn.Linear(10, 10, bias=False)
        self.b.weight = self.a.weight


def test_shared_param_counted_once_when_two_units_below() -> None:
    """A parameter held by two wrapped units below a module is subtracted once from its
    remainder (torch subtracts it twice; the one documented difference)."""
    model = nn.Sequential(TiedBlock())
    block = model[0]
    assert isinstance(block, TiedBlock)
    torch_policy, our_policy = (
        functools.partial(fn, min_num_params=50)
        for fn in (torch_wrap.size_based_auto_wrap_policy, fs_wrap.size_based_auto_wrap_policy)
    )
    # a and b hold 100 numel each (the same weight). The block's remainder is its own 60 numel
    # here (>= 50: wrapped); torch computes 160 - 100 - 100 = -40 and does not wrap it.
    assert our_targets(model, our_policy) == [block.a, block.b, block]
    assert torch_recursive_targets(model, torch_policy) == [block.a, block.b]


def test_tied_weight_counted_in_each_unit_when_siblings() -> None:
    """A weight tied between sibling subtrees counts for each sibling, as in torch."""
    model = ToyTransformer(tie_weights=True)
    policy = functools.partial(fs_wrap.size_based_auto_wrap_policy, min_num_params=100)
    # head: tied 128-numel weight + 16 bias = 144 >= 100, even though embed holds the weight.
    targets = our_targets(model, policy)
    assert model.embed in targets and model.head in targets


def test_shared_module_walked_once_when_two_parents() -> None:
    """A module under two parents is a target once and its numel is not counted twice."""
    model = SharedModuleModel()
    shared = model.first[0]
    targets = our_targets(model, fs_wrap.always_wrap_policy)
    assert targets.count(shared) == 1
    seen: list[tuple[nn.Module, bool, int]] = []

    def spy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        seen.append((module, recurse, nonwrapped_numel))
        return recurse or module is shared

    our_targets(model, spy)
    assert [numel for module, recurse, numel in seen if module is model.second and not recurse] == [
        21  # Linear(6, 3) only: the shared Linear was claimed under `first`
    ]


def test_policy_called_with_keywords_when_legacy() -> None:
    """Legacy policies receive module/recurse/nonwrapped_numel as keywords, as in torch."""
    calls: list[dict[str, Any]] = []

    def policy(**kwargs: Any) -> bool:
        calls.append(kwargs)
        return True

    model = nested_sequential()
    our_targets(model, policy)
    assert calls[0] == {"module": model, "recurse": True, "nonwrapped_numel": 202}
    assert all(set(call) == {"module", "recurse", "nonwrapped_numel"} for call in calls)
    assert not any(call["module"] is model and not call["recurse"] for call in calls)


# ---------------------------------------------------------------------------
# Policy objects against torch's _run_policy
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("classes_key", sorted(MODULE_CLASS_SETS))
@pytest.mark.parametrize("model_key", sorted(MODELS))
def test_module_wrap_policy_targets_match_torch(model_key: str, classes_key: str) -> None:
    """ModuleWrapPolicy picks the same modules as torch's, the root included."""
    model = MODELS[model_key]()
    classes = MODULE_CLASS_SETS[classes_key]
    expected = torch_wrap.ModuleWrapPolicy(classes)._run_policy(model, set(), {})
    actual = ModuleWrapPolicy(classes)._run_policy(model, set(), {})
    assert set(actual) == set(expected)
    assert_post_order(list(actual))


def test_module_wrap_policy_includes_root_when_root_matches() -> None:
    """The root is a target when it is an instance of a listed class (as in torch)."""
    model = nested_sequential()
    targets = list(ModuleWrapPolicy({nn.Sequential})._run_policy(model, set(), {}))
    assert targets == [model.get_submodule("2.1"), model[2], model]


@pytest.mark.parametrize("model_key", sorted(MODELS))
def test_custom_policy_targets_match_torch(model_key: str) -> None:
    """CustomPolicy picks the same modules with the same kwargs as torch's."""
    model = MODELS[model_key]()

    def lambda_fn(module: nn.Module) -> bool | dict[str, Any]:
        if isinstance(module, nn.Linear) and module.out_features == 16:
            return {"mixed_precision": "bf16"}
        return isinstance(module, (nn.TransformerEncoderLayer, nn.Sequential, nn.LayerNorm))

    root_kwargs = {"mixed_precision": None, "use_orig_params": True}
    expected = torch_wrap.CustomPolicy(lambda_fn)._run_policy(model, set(), root_kwargs)
    actual = CustomPolicy(lambda_fn)._run_policy(model, set(), root_kwargs)
    assert actual == expected
    assert_post_order(list(actual))


def test_custom_policy_overrides_kwargs_when_dict_returned() -> None:
    """A returned dict overrides the root kwargs for that module only."""
    model = nested_sequential()
    root_kwargs = {"a": 1, "b": 2}

    def lambda_fn(module: nn.Module) -> bool | dict[str, Any]:
        if module is model[0]:
            return {"b": 3, "c": 4}
        return module is model[2]

    targets = CustomPolicy(lambda_fn)._run_policy(model, set(), root_kwargs)
    assert targets == {model[0]: {"a": 1, "b": 3, "c": 4}, model[2]: {"a": 1, "b": 2}}
    assert root_kwargs == {"a": 1, "b": 2}


def test_custom_policy_skips_module_when_empty_dict() -> None:
    """An empty dict means the module is not wrapped."""
    model = nested_sequential()
    assert CustomPolicy(lambda m: {})._run_policy(model, set(), {"a": 1}) == {}


def test_custom_policy_raises_when_lambda_returns_other() -> None:
    """A lambda returning neither bool nor dict raises a ValueError naming the module."""
    model = nested_sequential()
    bad = model.get_submodule("2.1")
    policy = CustomPolicy(lambda m: 1 if m is bad else False)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match=r"2\.1 \(Sequential\).*returned 1"):
        policy._run_policy(model, set(), {})


@pytest.mark.parametrize(
    "policy",
    [
        ModuleWrapPolicy({nn.Linear}),
        CustomPolicy(is_linear),
        functools.partial(fs_wrap.lambda_auto_wrap_policy, lambda_fn=is_linear),
    ],
    ids=["module_wrap", "custom", "callable"],
)
def test_run_policy_copies_kwargs_when_targets_share_root(policy: Any) -> None:
    """Each target gets its own shallow copy of the root kwargs."""
    model = nested_sequential()
    root_kwargs = {"a": 1}
    targets = resolve_policy(policy)._run_policy(model, set(), root_kwargs)  # type: ignore[union-attr]
    kwargs_dicts = list(targets.values())
    assert len(kwargs_dicts) == 4 and all(d == root_kwargs for d in kwargs_dicts)
    kwargs_dicts[0]["a"] = 2
    assert root_kwargs == {"a": 1} and kwargs_dicts[1] == {"a": 1}


# ---------------------------------------------------------------------------
# Ignored modules
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy_key", sorted(CALLABLE_POLICIES))
def test_callable_policy_skips_subtree_when_ignored(policy_key: str) -> None:
    """Ignored subtrees are skipped and their parameters not counted, as in torch."""
    model = ToyTransformer()
    ignored_roots: set[nn.Module] = {model.layers[0], model.head}
    torch_policy, our_policy = both_callable_policies(policy_key)
    expected = torch_recursive_targets(model, torch_policy, ignored_roots)
    assert our_targets(model, our_policy, ignored_roots) == expected
    assert our_targets(model, our_policy, expand_ignored(ignored_roots)) == expected


@pytest.mark.parametrize("policy_cls", [ModuleWrapPolicy, CustomPolicy])
def test_policy_object_skips_subtree_when_ignored(policy_cls: type[_Policy]) -> None:
    """Policy objects skip ignored subtrees, given either the roots or the expanded set."""
    model = ToyTransformer()
    ignored_roots: set[nn.Module] = {model.layers[0]}
    arg: Any = {nn.Linear} if policy_cls is ModuleWrapPolicy else is_linear
    torch_cls = getattr(torch_wrap, policy_cls.__name__)
    expected = torch_cls(arg)._run_policy(model, expand_ignored(ignored_roots), {})
    ours = policy_cls(arg)  # type: ignore[call-arg]
    assert set(ours._run_policy(model, ignored_roots, {})) == set(expected)
    assert set(ours._run_policy(model, expand_ignored(ignored_roots), {})) == set(expected)
    assert model.layers[0].linear1 not in expected


def test_run_policy_returns_nothing_when_root_ignored() -> None:
    """Ignoring the root leaves nothing to wrap."""
    model = nested_sequential()
    for policy in (ModuleWrapPolicy({nn.Linear}), fs_wrap.always_wrap_policy):
        assert resolve_policy(policy)._run_policy(model, {model}, {}) == {}  # type: ignore[union-attr]


# ---------------------------------------------------------------------------
# resolve_policy
# ---------------------------------------------------------------------------


def test_resolve_policy_passes_through_when_none_or_policy() -> None:
    """None stays None and a _Policy is returned unchanged."""
    policy = ModuleWrapPolicy({nn.Linear})
    assert resolve_policy(None) is None
    assert resolve_policy(policy) is policy


def test_resolve_policy_adapts_when_callable() -> None:
    """A legacy callable becomes a _Policy that never targets the root."""
    model = nn.Sequential(nn.Linear(2, 2))
    resolved = resolve_policy(fs_wrap.always_wrap_policy)
    assert isinstance(resolved, _Policy)
    assert list(resolved._run_policy(model, set(), {})) == [model[0]]


def test_resolve_policy_raises_when_class_set() -> None:
    """A bare set of classes is rejected with a hint to use ModuleWrapPolicy."""
    with pytest.raises(TypeError, match="ModuleWrapPolicy"):
        resolve_policy({nn.Linear})  # type: ignore[arg-type]


def test_module_wrap_policy_callable_when_used_as_legacy() -> None:
    """ModuleWrapPolicy's __call__ always recurses and wraps instances, as torch's."""
    policy = ModuleWrapPolicy({nn.Linear})
    linear, relu = nn.Linear(2, 2), nn.ReLU()
    assert policy(relu, recurse=True, nonwrapped_numel=0)
    assert policy(linear, recurse=False, nonwrapped_numel=0)
    assert not policy(relu, recurse=False, nonwrapped_numel=0)
    assert repr(policy) == "ModuleWrapPolicy({Linear})"


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module_classes", "message"),
    [
        (nn.Linear, r"class Linear itself; wrap it in a set: \{Linear\}"),
        ({nn.Linear(2, 2)}, "an instance, not a class"),
        ({"Linear"}, "of type str"),
        ("Linear", "iterable of module classes"),
        (42, "iterable of module classes"),
    ],
    ids=["bare_class", "instance", "class_name", "string", "int"],
)
def test_module_wrap_policy_raises_when_not_classes(module_classes: Any, message: str) -> None:
    """ModuleWrapPolicy rejects anything but an iterable of classes, saying how to fix it."""
    with pytest.raises(TypeError, match=message):
        ModuleWrapPolicy(module_classes)


@pytest.mark.parametrize(
    ("policy_name", "kwargs", "arg_name"),
    [
        (
            "transformer_auto_wrap_policy",
            {"transformer_layer_cls": nn.Linear},
            "transformer_layer_cls",
        ),
        (
            "transformer_auto_wrap_policy",
            {"transformer_layer_cls": [nn.Linear(2, 2)]},
            "transformer_layer_cls",
        ),
        (
            "size_based_auto_wrap_policy",
            {"min_num_params": 0, "force_leaf_modules": nn.Linear},
            "force_leaf_modules",
        ),
        (
            "size_based_auto_wrap_policy",
            {"min_num_params": 0, "exclude_wrap_modules": {"x"}},
            "exclude_wrap_modules",
        ),
    ],
    ids=["bare_class", "instances", "force_leaf", "exclude_wrap"],
)
def test_callable_policy_raises_when_class_arg_invalid(
    policy_name: str, kwargs: dict[str, Any], arg_name: str
) -> None:
    """Class-set arguments of the callable policies are validated, naming the argument."""
    policy = functools.partial(getattr(fs_wrap, policy_name), **kwargs)
    with pytest.raises(TypeError, match=arg_name):
        our_targets(nested_sequential(), policy)


def test_custom_policy_raises_when_not_callable() -> None:
    """CustomPolicy needs a callable."""
    with pytest.raises(TypeError, match="needs a callable"):
        CustomPolicy({nn.Linear})  # type: ignore[arg-type]


def test_transformer_policy_accepts_iterables_when_list_or_tuple() -> None:
    """Lists and tuples of classes work as well as sets, as in torch."""
    for classes in ([nn.Linear], (nn.Linear,), frozenset({nn.Linear})):
        policy = functools.partial(
            fs_wrap.transformer_auto_wrap_policy, transformer_layer_cls=classes
        )
        assert len(our_targets(nested_sequential(), policy)) == 4


# ---------------------------------------------------------------------------
# enable_wrap / wrap
# ---------------------------------------------------------------------------


class Wrapper(nn.Module):
    """Stand-in wrapper class recording its kwargs."""

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.module = module
        self.kwargs = kwargs


def test_wrap_returns_module_when_outside_context() -> None:
    """wrap() is the identity outside enable_wrap."""
    linear = nn.Linear(2, 2)
    assert wrap(linear, a=1) is linear


def test_wrap_merges_kwargs_when_inside_context() -> None:
    """wrap() builds wrapper_cls with the context kwargs, its own kwargs winning."""
    linear = nn.Linear(2, 2)
    with enable_wrap(wrapper_cls=Wrapper, a=1, b=2):
        wrapped = wrap(linear, b=3)
    assert isinstance(wrapped, Wrapper)
    assert wrapped.module is linear and wrapped.kwargs == {"a": 1, "b": 3}
    assert wrap(linear) is linear


def test_wrap_matches_torch_when_inside_context() -> None:
    """Our wrap() and torch's give the same wrapper kwargs."""
    with torch_wrap.enable_wrap(wrapper_cls=Wrapper, a=1, b=2):
        expected = torch_wrap.wrap(nn.Linear(2, 2), b=3, c=4)
    with enable_wrap(wrapper_cls=Wrapper, a=1, b=2):
        actual = wrap(nn.Linear(2, 2), b=3, c=4)
    assert isinstance(actual, Wrapper) and isinstance(expected, Wrapper)
    assert actual.kwargs == expected.kwargs


def test_enable_wrap_raises_when_nested() -> None:
    """Nested contexts are rejected (as in torch) and the outer one stays active."""
    with enable_wrap(wrapper_cls=Wrapper, a=1):
        with (
            pytest.raises(NotImplementedError, match="cannot be nested"),
            enable_wrap(wrapper_cls=Wrapper),
        ):
            pass
        assert isinstance(wrap(nn.Linear(2, 2)), Wrapper)
    assert isinstance(wrap(nn.Linear(2, 2)), nn.Linear)


def test_enable_wrap_resets_when_body_raises() -> None:
    """An exception inside the context still ends it."""
    with pytest.raises(RuntimeError), enable_wrap(wrapper_cls=Wrapper):
        raise RuntimeError("boom")
    linear = nn.Linear(2, 2)
    assert wrap(linear) is linear


def test_enable_wrap_raises_when_wrapper_not_callable() -> None:
    """wrapper_cls must be callable."""
    with pytest.raises(TypeError, match="wrapper_cls"), enable_wrap(wrapper_cls=None):
        pass


# ---------------------------------------------------------------------------
# Package hygiene
# ---------------------------------------------------------------------------


def test_module_exports_public_names_when_imported() -> None:
    """__all__ names torch's public API plus resolve_policy, and all of them exist."""
    assert set(torch_wrap.__all__) <= set(fs_wrap.__all__)
    assert set(fs_wrap.__all__) - set(torch_wrap.__all__) == {"resolve_policy"}
    assert all(hasattr(fs_wrap, name) for name in fs_wrap.__all__)


def test_module_avoids_torch_fsdp_when_source_read() -> None:
    """fullshard.wrap does not import torch.distributed.fsdp."""
    tree = ast.parse(Path(fs_wrap.__file__).read_text(encoding="utf-8"))
    imported = [
        name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for name in (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
        )
    ]
    assert imported and not [name for name in imported if "fsdp" in name]
