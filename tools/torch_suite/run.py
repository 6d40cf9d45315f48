#!/usr/bin/env python3
"""Run torch's own FSDP1 test files on 2 gloo CPU ranks, against torch's FSDP or fullshard's.

    .venv/bin/python tools/torch_suite/run.py test_fsdp_apply.py --mode both

Each file is copied into a temporary folder with its hard-coded CUDA devices rewritten to the
CPU (REWRITES below), run with pytest under FULLSHARD_TORCH_SUITE=<mode> (sitecustomize.py in
this folder does the rest), and its per-test outcomes are written to <out>/<mode>/<file>.json.
A summary table and the tests torch passes but fullshard does not go to <out>/summary.md.
See README.md.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
MODES = ("torch", "fullshard")
LOCK = "/tmp/fullshard-ranks.lock"
"""Held around every pytest run: one multi-rank job at a time on this machine."""

_ARGS = r"(?:[^()]|\([^()]*\))*"  # a call's arguments, with one level of nested parentheses
_CUDA = r"[\"']cuda(?::\d+)?[\"']"  # the string "cuda" or "cuda:N"
_CURRENT = (
    r"torch\.(?:cuda\.current_device|accelerator\.current_device_index"
    r"|get_device_module\([^()]*\)\.current_device)\(\)"
)
REWRITES: list[tuple[str, str, str]] = [
    # (pattern, replacement, what it does); applied in this order
    (
        rf"torch\.device\(\s*{_CUDA}(?:\s*,{_ARGS})?\)",
        'torch.device("cpu")',
        'torch.device("cuda"[, i]) -> torch.device("cpu")',
    ),
    (rf"\.cuda\({_ARGS}\)", "", "x.cuda(...) -> x"),
    (rf"\b(device|device_type)(\s*=\s*){_CUDA}", r'\1\2"cpu"', 'device="cuda" -> device="cpu"'),
    (rf"\.to\(\s*{_CUDA}", '.to("cpu"', '.to("cuda" -> .to("cpu"'),
    (r"\.to\((?:self\.)?rank\)", '.to("cpu")', '.to(self.rank) -> .to("cpu")'),
    (
        r"torch\.device\((?:self\.)?rank\)",
        'torch.device("cpu")',
        'torch.device(rank) -> torch.device("cpu")',
    ),
    (
        r"torch\.device\(\s*([\w.]+)\s*,\s*0\s*\)",
        r"torch.device(\1)",
        "torch.device(device_type, 0) -> torch.device(device_type)",
    ),
    (
        rf"torch\.device\(\s*[\w.]+\s*,\s*{_CURRENT}\s*\)",
        'torch.device("cpu")',
        'torch.device(device_type, <current device index>) -> torch.device("cpu")',
    ),
    (
        _CURRENT,
        'torch.device("cpu")',
        'torch.cuda.current_device(), torch.accelerator.current_device_index() -> torch.device("cpu")',
    ),
    (
        rf"torch\.(?:cuda|accelerator)\.(?:synchronize|set_device|set_device_index)\({_ARGS}\)",
        "None",
        "torch.cuda/accelerator.synchronize(...), set_device(...), set_device_index(...) -> None",
    ),
    (
        r"(?:torch\.(?:cuda|accelerator)|_get_device_module\([^()]*\))\.device_count\(\)",
        "2",
        "torch.cuda/accelerator.device_count() -> 2 (the ranks; on CPU it is 0 or 1)",
    ),
    (
        r"torch\.cuda\.manual_seed\(",
        "torch.manual_seed(",
        "torch.cuda.manual_seed -> torch.manual_seed",
    ),
    (r"\bdevice_ids=\[[^\]]*\]", "device_ids=None", "DDP(..., device_ids=[r]) -> device_ids=None"),
    (
        r"([\"']device_id[\"']\s*:\s*)(?:self\.)?rank\b",
        r'\1torch.device("cpu")',
        '{"device_id": self.rank} -> {"device_id": torch.device("cpu")}',
    ),
    (
        r"([\"']device_ids[\"']\s*:\s*)\[[^\]]*\]",
        r"\1None",
        '{"device_ids": [self.rank]} -> {"device_ids": None}',
    ),
]


def rewrite(source: str) -> tuple[str, dict[str, int]]:
    """The file with its CUDA devices rewritten, and how often each rewrite fired."""
    fired = {}
    for pattern, replacement, what in REWRITES:
        source, n = re.subn(pattern, replacement, source)
        if n:
            fired[what] = n
    return source, fired


def _last_error(lines: list[str]) -> dict | None:
    """A traceback's last 'SomeError: ...' line (for a rank, its own error rather than the
    harness's wrapper around it) and the innermost non-stdlib frames above it."""
    errors = [
        i
        for i, line in enumerate(lines)
        if re.match(r"^[\w.]*(Error|Exception|Failed|Exit)\b", line)
        and "in worker process" not in line
    ]
    if not errors:
        return None
    stdlib = f'File "{sys.base_prefix}'
    frames = [
        line
        for line in lines[: errors[-1]]
        if line.startswith("File ") and not line.startswith(stdlib)
    ]
    return {"error": lines[errors[-1]][:300], "where": frames[-3:]}


def _failure(text: str) -> dict:
    """The failure's error: with one section per failed rank (FSDPTest), the first rank's
    that is not just its peer having died ("Connection closed by peer")."""
    lines = [re.sub(r"^E\s?", "", line).strip() for line in text.splitlines()]
    cuts = [i for i, line in enumerate(lines) if re.search(r"Process \d+ exited with", line)]
    sections = [lines[i:j] for i, j in zip([0, *cuts], [*cuts, len(lines)])]
    found = [f for f in map(_last_error, sections) if f]
    if not found:
        return {"error": next((line for line in lines if line), "")[:300]}
    return next((f for f in found if "closed by peer" not in f["error"]), found[0])


def parse_junit(path: Path) -> list[dict]:
    tests = []
    for case in ET.parse(path).iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        test = {
            "id": f"{cls.rpartition('.')[2]}::{name}" if cls else name,
            "outcome": "passed",
            "time": float(case.get("time") or 0),
        }
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                test["outcome"] = "failed" if tag == "failure" else tag
                message = node.get("message") or ""
                if tag == "skipped":
                    test["message"] = message[:300]
                else:
                    test.update(_failure(node.text or message))  # the text is the full report
                break
        tests.append(test)
    return tests


def run_pytest(workdir: Path, targets: list[str], mode: str, args, log) -> tuple:
    """One pytest run (under the lock): its tests, return code, whether it timed out, and its
    seconds (not counting the wait for the lock)."""
    junit = workdir / "junit.xml"
    junit.unlink(missing_ok=True)
    cmd = [
        "nice",
        "-n",
        "10",
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rA",
        f"--junitxml={junit}",
        *targets,
    ]
    if args.k:
        cmd += ["-k", args.k]
    if importlib.util.find_spec("pytest_timeout"):
        cmd += [f"--timeout={args.timeout}"]
    env = dict(os.environ, FULLSHARD_TORCH_SUITE=mode)
    if mode == "fullshard" and args.transport == "c10d":
        # fullshard's c10d transport: gloo's own collectives, called through dist.*, which
        # the tests that count collectives wrap (common_fsdp.patch_all_gather, ...).
        env.update(FULLSHARD_SHM="0", FULLSHARD_GLOO_RINGS="0")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    log.write(f"$ FULLSHARD_TORCH_SUITE={mode} {' '.join(cmd)}\n")
    log.flush()
    timed_out = False
    with open(LOCK, "a") as lock:
        if not args.no_lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=args.file_timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)  # pytest and the ranks it spawned
            proc.wait()
    seconds = time.monotonic() - start
    return (parse_junit(junit) if junit.exists() else []), proc.returncode, timed_out, seconds


def _poisoned(tests: list[dict]) -> list[str]:
    """Tests skipped only because an earlier test of their class failed (FSDPTestContinuous)."""
    return [
        t["id"]
        for t in tests
        if t["outcome"] == "skipped" and t.get("message", "").startswith("Previous test failed")
    ]


def run_file(src: Path, mode: str, args) -> dict:
    # fullshard on gloo's own collectives is a column of its own (fullshard-c10d)
    out_dir = args.out / (
        mode if mode == "torch" or args.transport == "default" else f"{mode}-c10d"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    source, fired = rewrite(src.read_text())
    with (
        tempfile.TemporaryDirectory(prefix="torch_suite_") as tmp,
        open(out_dir / f"{src.stem}.log", "w") as log,
    ):
        workdir = Path(tmp)
        (workdir / "pytest.ini").write_text("[pytest]\n")  # pins rootdir; no inherited config
        (workdir / src.name).write_text(source)
        tests, rc, timed_out, wall = run_pytest(workdir, [src.name], mode, args, log)
        # A failure in an FSDPTestContinuous class skips the rest of the class: run those
        # again, in fresh processes, until each has run or hit the same skip on its own.
        reruns, todo = 0, _poisoned(tests)
        while todo and not timed_out and reruns < len(tests):
            reruns += 1
            again, _, timed_out, seconds = run_pytest(
                workdir, [f"{src.name}::{t}" for t in todo], mode, args, log
            )
            wall += seconds
            by_id = {t["id"]: dict(t, rerun=True) for t in again}
            tests = [by_id.get(t["id"], t) for t in tests]
            todo = [t for t in _poisoned(again) if t != todo[0]]
        log_tail = (out_dir / f"{src.stem}.log").read_text()[-3000:]
    json_path = out_dir / f"{src.stem}.json"
    if args.k and json_path.exists():  # a selection: update those tests of the last full run
        by_id = {t["id"]: t for t in tests}
        old = json.loads(json_path.read_text())["tests"]
        tests = [by_id.pop(t["id"], t) for t in old] + list(by_id.values())
    counts = {
        k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")
    }
    result = {
        "file": src.name,
        "mode": mode,
        "wall_s": round(wall, 1),  # pytest runs, reruns included; not the lock waits
        "returncode": rc,
        "timed_out": timed_out,
        "reruns": reruns,
        "total": len(tests),
        **counts,
        "last_k": args.k,
        "rewrites": fired,
        "tests": tests,
    }
    if not tests:
        result["log_tail"] = log_tail
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    return result


def summarize(out: Path) -> str:
    results = {}
    for mode in MODES:
        for path in sorted((out / mode).glob("*.json")):
            results.setdefault(path.stem, {})[mode] = json.loads(path.read_text())
    rows = [
        "| file | torch passed/total | fullshard passed/total | torch s | fullshard s |",
        "| --- | --- | --- | --- | --- |",
    ]
    regressions = []
    for stem, by_mode in sorted(results.items()):
        cells = []
        for mode in MODES:
            r = by_mode.get(mode)
            note = " (timeout)" if r and r["timed_out"] else ""
            cells.append(f"{r['passed']}/{r['total']}{note}" if r else "-")
        times = [str(by_mode[m]["wall_s"]) if m in by_mode else "-" for m in MODES]
        rows.append(f"| {stem} | {' | '.join(cells)} | {' | '.join(times)} |")
        if "torch" in by_mode and "fullshard" in by_mode:
            fs = {t["id"]: t for t in by_mode["fullshard"]["tests"]}
            for t in by_mode["torch"]["tests"]:
                other = fs.get(t["id"])  # None: not selected (-k) or the run timed out
                if t["outcome"] == "passed" and other and other["outcome"] != "passed":
                    why = other.get("error") or other.get("message", "")
                    regressions.append(f"- {stem}::{t['id']} ({other['outcome']}): {why}")
    text = "\n".join(rows) + "\n\n## torch passes, fullshard does not\n\n"
    text += "\n".join(regressions or ["(none)"]) + "\n"
    (out / "summary.md").write_text(text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "files", nargs="*", help="test file names (default: every test_*.py in --src)"
    )
    parser.add_argument(
        "--suite",
        choices=["fsdp1", "fsdp2"],
        default="fsdp1",
        help="which files: FSDP1's test_*.py, or FSDP2's test_fully_shard_*.py",
    )
    parser.add_argument("--src", type=Path, help="test files (default by --suite)")
    parser.add_argument("--out", type=Path, help="results (default by --suite)")
    parser.add_argument(
        "--transport",
        choices=["default", "c10d"],
        default="default",
        help="fullshard mode: its default transports, or gloo's collectives through dist.*",
    )
    parser.add_argument("--mode", choices=[*MODES, "both"], default="both")
    parser.add_argument("-k", help="pytest -k expression selecting tests")
    parser.add_argument("--jobs", type=int, default=1, choices=[1], help="only 1 (2 cores)")
    parser.add_argument(
        "--timeout", type=int, default=300, help="per-test seconds (pytest-timeout)"
    )
    parser.add_argument("--file-timeout", type=int, default=1800, help="per pytest run, seconds")
    parser.add_argument("--no-lock", action="store_true", help=f"do not take {LOCK}")
    parser.add_argument("--summary", action="store_true", help="only print the summary of --out")
    args = parser.parse_args()
    fsdp2 = args.suite == "fsdp2"
    args.src = args.src or Path("/work/torch_tests/" + ("fsdp2_files" if fsdp2 else "files"))
    args.out = args.out or Path("/work/torch_tests/" + ("results_fsdp2" if fsdp2 else "results"))
    pattern = "test_fully_shard_*.py" if fsdp2 else "test_*.py"
    if not args.summary:
        names = args.files or sorted(p.name for p in args.src.glob(pattern))
        modes = MODES if args.mode == "both" else (args.mode,)
        for name in names:
            src = args.src / (name if name.endswith(".py") else f"{name}.py")
            for mode in modes:
                r = run_file(src, mode, args)
                print(
                    f"{src.name} [{mode}]: {r['passed']}/{r['total']} passed, {r['failed']} failed, "
                    f"{r['error']} errors, {r['skipped']} skipped in {r['wall_s']} s"
                    + (" (timed out)" if r["timed_out"] else ""),
                    flush=True,
                )
    print(summarize(args.out))
    return 0


if __name__ == "__main__":
    shutil.which("nice") or sys.exit("run.py needs nice(1)")
    sys.exit(main())
