"""The FSDP2 front door: ``fully_shard`` and ``FSDPModule``, on the engine the FSDP1 door
(``fully_sharded_data_parallel``) uses too.

- ``shard``: ``fully_shard`` (checks, the engine's settings for a call, meshes) and
  ``register_fsdp_forward_method``;
- ``module``: ``FSDPModule``, the methods ``fully_shard`` adds to a module's class;
- ``state``: what a sharded module keeps, and the forward hooks that drive its unit.
"""

from __future__ import annotations

from .module import FSDPModule, UnshardHandle, share_comm_ctx
from .shard import fully_shard, register_fsdp_forward_method

__all__ = [
    "FSDPModule",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
