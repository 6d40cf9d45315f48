"""Per-file comparison of run.py results: torch, and fullshard at one or more commits.

    python tools/torch_suite/table.py --torch OUT/torch --fullshard before=DIR1 after=DIR2

Each DIR is a ``<out>/<mode>`` folder written by run.py (one ``<file>.json`` per test file).
Prints a markdown table (passed/total per file and column, totals last) and, for the last
fullshard column, every test torch passes and fullshard does not, with its error line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _load(folder: Path) -> dict[str, dict[str, dict[str, str]]]:
    """file -> test id -> {outcome, error}."""
    results: dict[str, dict[str, dict[str, str]]] = {}
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        results[path.stem] = {t["id"]: t for t in data["tests"]}
    return results


def _passed(tests: dict[str, dict[str, str]]) -> int:
    return sum(t["outcome"] == "passed" for t in tests.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--torch", type=Path, required=True)
    parser.add_argument("--fullshard", nargs="+", required=True, help="NAME=DIR ...")
    args = parser.parse_args()
    torch_results = _load(args.torch)
    columns = [(n, _load(Path(d))) for n, d in (c.split("=", 1) for c in args.fullshard)]
    header = ["file", "torch on CPU", *(f"fullshard {name}" for name, _ in columns)]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    totals = [0] * (1 + len(columns))
    count = 0
    for file, tests in torch_results.items():
        cells = [f"{_passed(tests)}/{len(tests)}"]
        totals[0] += _passed(tests)
        count += len(tests)
        for i, (_, results) in enumerate(columns, start=1):
            theirs = results.get(file, {})
            cells.append(f"{_passed(theirs)}/{len(theirs)}" if theirs else "not run")
            totals[i] += _passed(theirs)
        print(f"| {file} | " + " | ".join(cells) + " |")
    print("| **all** | " + " | ".join(f"**{t}/{count}**" for t in totals) + " |")
    name, last = columns[-1]
    print(f"\nTorch passes, fullshard {name} does not:\n")
    for file, tests in torch_results.items():
        for test_id, test in tests.items():
            mine = last.get(file, {}).get(test_id)
            if test["outcome"] == "passed" and (mine is None or mine["outcome"] != "passed"):
                error = (mine or {}).get("error") or (mine or {}).get("outcome", "not run")
                print(f"- {file}::{test_id}: {error[:200]}")


if __name__ == "__main__":
    main()
