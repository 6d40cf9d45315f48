"""The ``fullshard`` command: ``train``, ``plan`` and ``bench``.

The command-line layer: it may import the engine, never the reverse (tests/unit/test_layers.py).

- `fullshard.cli.launch`: ``fullshard train`` in the calling process: validates the options
  (importing no torch, so a refusal answers at once), then starts the ranks through torch's
  elastic launcher.
- `fullshard.cli.train`: one rank of ``fullshard train`` (``python -m fullshard.cli.train``),
  with its options (`fullshard.cli.train_options`), its model sharded through either front
  door, ``--api fsdp1`` or ``fsdp2`` (`fullshard.cli.train_model`), its data
  (`fullshard.cli.train_data`) and what it leaves in ``--out`` (`fullshard.cli.train_output`).
- `fullshard.cli.plan`: per-rank memory and traffic from the model in `fullshard.memory`, of
  a shape from `fullshard.cli.plan_shapes`; imports no torch, so it answers at once.
- `fullshard.cli.bench`: one training step timed under local, DDP, torch's FSDP and fullshard.
"""

from __future__ import annotations

import os
import sys

__all__ = ["main"]

_USAGE = """\
usage: fullshard <command> [options]

commands:
  train   train a byte-level GPT with fullshard's FSDP on local (or multi-node) ranks
  plan    per-rank memory and traffic of a model on N devices (no GPUs needed)
  bench   time one training step: local, DDP, torch FSDP1/FSDP2 and fullshard

'fullshard <command> --help' describes a command's options.
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        status = _run(argv)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return status
    except BrokenPipeError:  # the reader went away (`fullshard plan ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 128 + 13  # what a shell reports for SIGPIPE


def _run(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "plan":
        from .plan import main as plan_main

        return plan_main(rest)
    if command == "bench":
        from .bench import main as bench_main

        return bench_main(rest)
    if command == "train":
        from .launch import main as train_main

        return train_main(rest)
    print(f"fullshard: unknown command {command!r}\n\n{_USAGE}", end="", file=sys.stderr)
    return 2
