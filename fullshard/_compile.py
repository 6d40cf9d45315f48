"""How fullshard's bookkeeping stays out of ``torch.compile``'s graphs.

# [Note: torch.compile runs the wrapper eagerly]
# fullshard's bookkeeping (lazy init, the transport's setup, storage resizes, collectives,
# state machines, hooks) is Python that dynamo cannot put in a graph: tracing it graph-breaks
# dozens of times per unit (gloo work handles, `.item()` in the transport's setup, enum
# state), and what it does trace is wrong to compile (inductor cannot lower the
# `untyped_storage().resize_` of unshard/reshard, and a collective captured in a graph would
# run once per graph replay, not once per step). So dynamo never traces it:
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
# (`torch._dynamo.config.inline_inbuilt_nn_modules`), which does exactly that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__: list[str] = []

_F = TypeVar("_F", bound=Callable[..., Any])


def eager(fn: _F) -> _F:
    """Never compiled, nor anything it calls: dynamo graph-breaks around a call to it."""
    return cast(_F, torch.compiler.disable(fn, recursive=True))


def eager_frame(fn: _F) -> _F:
    """This frame runs eagerly, but the frames it calls may be compiled."""
    return cast(_F, torch.compiler.disable(fn, recursive=False))
