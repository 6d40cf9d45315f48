"""Fault injection for `fullshard train`'s ranks (tests/cli/test_cli.py puts this folder on
PYTHONPATH, so Python imports it at start-up in every rank).

FULLSHARD_TEST_FAULT=forward|backward|save: in the first attempt only
(TORCHELASTIC_RESTART_COUNT=0), rank 1 exits abruptly at its 11th all-gather of blocks.1
(step 6's forward: each step gathers it twice), its 6th reduce-scatter of blocks.0 (step 6's
backward), or in its second checkpoint save (its DCP write, at step 8). Without the variable this does nothing.
"""

import os

_FAULT = os.environ.get("FULLSHARD_TEST_FAULT")

if _FAULT and os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    import time
    from collections import Counter

    import torch.distributed.checkpoint as dcp

    from fullshard._comm import collectives as comm

    _calls: Counter[str] = Counter()

    def _die_on(kind: str, label: str, count: int, delay_s: float = 0.0) -> None:
        _calls[(kind, label)] += 1
        if _calls[(kind, label)] == count:
            time.sleep(delay_s)
            os._exit(17)

    _all_gather = comm.all_gather_into
    _reduce_scatter = comm.reduce_scatter_into
    _dcp_save = dcp.save

    def all_gather_into(output, shard, group, label, *args, **kwargs):  # type: ignore[no-untyped-def]
        if _FAULT == "forward":
            _die_on("all_gather", label, 11 if label == "blocks.1" else -1)
        return _all_gather(output, shard, group, label, *args, **kwargs)

    def reduce_scatter_into(output, full, group, label, **kwargs):  # type: ignore[no-untyped-def]
        if _FAULT == "backward":
            _die_on("reduce_scatter", label, 6 if label == "blocks.0" else -1)
        return _reduce_scatter(output, full, group, label, **kwargs)

    def save(*args, **kwargs):  # type: ignore[no-untyped-def]
        if _FAULT == "save":
            # after rank 0 is inside the save's first collective, waiting for this rank (dying
            # at once raced rank 0's state-dict preparation against the launcher's SIGTERM,
            # which then stopped rank 0 before it could name the failed operation)
            _die_on("save", "", 2, delay_s=1.0)
        return _dcp_save(*args, **kwargs)

    comm.all_gather_into = all_gather_into
    comm.reduce_scatter_into = reduce_scatter_into
    dcp.save = save
