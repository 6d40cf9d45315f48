"""How fullshard's bookkeeping stays out of ``torch.compile``'s graphs (see the Note)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__: list[str] = []

# [Note: torch.compile runs the wrapper eagerly]
# fullshard's bookkeeping (lazy init, the transport's setup, storage resizes, collectives,
# state machines, hooks) is Python that dynamo cannot put in a graph: traced, it failed in the
# shared-memory transport's setup (`broadcast_object_list`), and after an eager step it
# graph-broke 16 times in one forward of a 3-unit model (37 times and 26 graphs over 24 steps
# of a 4-block GPT, which then ran 5x slower than eager: 172 ms against 32 ms a step on 2 CPU
# ranks); inductor could not lower the `untyped_storage().resize_` of unshard/reshard. So
# dynamo never traces it:
#
# - `FullyShardedDataParallel.forward` and `_run_forward` are skipped frames
#   (`eager_frame`): dynamo runs them eagerly, but frames they call are still compiled. The
#   wrapped module's forward, called from there, is therefore compiled as a frame of its own
#   (with the unsharded parameters' views as graph inputs), much as dynamo treats torch's
#   FSDP1, whose files it skips.
# - Everything the wrapper does around that call, and every runtime hook, is `eager`
#   (recursively disabled), so no frame under it is compiled either.
#
# A compiled parent module (the root's inner module calling nested units) graph-breaks once
# at each nested unit's call and resumes after it; each inner module compiles once per code
# object (blocks of one class share their compiled code, guarded on shapes and dtypes). The
# views a unit gives its modules are new tensors at every pre-forward, so dynamo must see
# them as graph inputs, not constants: modules are traced "unspecialized" by default
# (`torch._dynamo.config.inline_inbuilt_nn_modules`), which does exactly that. Measured after:
# the 3-unit model compiles into 3 graphs with 2 graph breaks; the GPT's block compiles once
# (1 graph, no recompilation over 24 steps; its root forward calls the blocks in a loop, and
# dynamo runs a frame that graph-breaks inside a loop eagerly), at 34-37 ms a step.


_F = TypeVar("_F", bound=Callable[..., Any])


def eager(fn: _F) -> _F:
    """Never compiled, nor anything it calls: dynamo graph-breaks around a call to it."""
    return cast(_F, torch.compiler.disable(fn, recursive=True))


def eager_frame(fn: _F) -> _F:
    """This frame runs eagerly, but the frames it calls may be compiled."""
    return cast(_F, torch.compiler.disable(fn, recursive=False))
