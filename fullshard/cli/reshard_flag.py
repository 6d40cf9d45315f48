"""``--reshard-after-forward {true,false,K}``: fully_shard's option on the command line, as
``fullshard plan`` and ``fullshard train`` read it (``--api fsdp2``).

Pure arithmetic, no torch: the planner imports it.
"""

from __future__ import annotations

import argparse

__all__ = ["add_argument", "factor_problem", "parse", "post_forward_shards"]


def parse(text: str) -> bool | int:
    """argparse ``type=``: ``true``/``false``, or a group size K of at least 1."""
    if text in ("true", "false"):
        return text == "true"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"true, false or a group size, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a group size is at least 1, not {value}")
    return value


def add_argument(group: argparse._ActionsContainer, help: str) -> None:
    """Add ``--reshard-after-forward`` (default None: the command's own default)."""
    group.add_argument(
        "--reshard-after-forward",
        type=parse,
        default=None,
        metavar="{true,false,K}",
        help=help,
    )


def post_forward_shards(
    reshard_after_forward: bool | int | None, shard_ranks: int
) -> tuple[bool, int | None]:
    """``reshard_after_forward`` as fully_shard reads it for ``shard_ranks`` ranks: whether it
    reshards after forward, and to how many ranks when fewer than all (1 means False, as
    torch says when it warns, and ``shard_ranks`` means True)."""
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return reshard_after_forward is not False, None
    if reshard_after_forward == 1:
        return False, None
    if reshard_after_forward >= shard_ranks:
        return True, None
    return True, reshard_after_forward


def factor_problem(reshard_after_forward: bool | int | None, shard_ranks: int) -> str | None:
    """torch's error text when an int K is not a factor of the shard group's ranks (its
    fully_shard raises it on every rank), else None."""
    k = reshard_after_forward
    if not isinstance(k, int) or isinstance(k, bool) or (k <= shard_ranks and shard_ranks % k == 0):
        return None
    return (
        "If passing reshard_after_forward as an int, it should be a factor of "
        f"{shard_ranks}, not {k}"
    )
