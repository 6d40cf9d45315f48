"""CPU device selection for the stacks under test, and nothing of their FSDP calls.

Put on ``PYTHONPATH`` by ``tests/support/stacks.py`` for both the torch run and the
fullshard run of a stack, so the two differ only in ``FULLSHARD_INSTALL``. Each patch is
applied right after its module executes (an import hook), and each only chooses devices:

- accelerate (``accelerate.state``): on a machine without an accelerator, accelerate runs
  a launched multi-process job as ``MULTI_CPU`` and drops its FSDP plugin, silently
  training with DDP. Here such a job keeps ``FSDP`` with its plugin (from the script or from
  ``accelerate launch``'s config, as on GPUs), on gloo, with the device ``cpu`` (accelerate
  picks ``cpu:<local rank>``, which torch's FSDP1 refuses as inconsistent with ``cpu``).
- Lightning (``lightning.fabric.connector``, ``lightning.pytorch.trainer.connectors.
  accelerator_connector``): ``FSDPStrategy`` with ``accelerator="cpu"`` is refused ("FSDP is
  only available on GPU") before anything runs; here the check sees a GPU flag, and the
  CPU accelerator stays.
- torchtitan (``torchtitan.tools.utils``): its device is the available accelerator "or
  cuda"; here, without one, it is the CPU.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


def _patch_accelerate_state(m: ModuleType) -> None:
    multi_cpu, fsdp = m.DistributedType.MULTI_CPU, m.DistributedType.FSDP

    prepare_backend = m.PartialState._prepare_backend

    def _prepare_backend(
        self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: Any = None
    ) -> Any:
        backend_name, distributed_type = prepare_backend(self, cpu, sagemaker_dp, backend)
        if distributed_type == m.DistributedType.NO and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return "gloo", multi_cpu
        return backend_name, distributed_type

    m.PartialState._prepare_backend = _prepare_backend

    set_device = m.PartialState.set_device

    def _set_device(self: Any) -> None:
        if self.device is None and self.distributed_type == multi_cpu:
            import torch

            self.device = torch.device("cpu")
            return
        set_device(self)

    m.PartialState.set_device = _set_device

    init = m.AcceleratorState.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        # AcceleratorState shares its state between instances and copies PartialState's into
        # it on each construction: the FSDP choice is made again every time.
        plugin = inspect.signature(init).bind(self, *args, **kwargs).arguments.get("fsdp_plugin")
        plugin = plugin if plugin is not None else getattr(self, "fsdp_plugin", None)
        if plugin is None and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            from accelerate.utils import FullyShardedDataParallelPlugin

            plugin = FullyShardedDataParallelPlugin()
        if plugin is not None and self.distributed_type == multi_cpu:
            first = getattr(self, "fsdp_plugin", None) is not plugin
            self.distributed_type = fsdp
            if first and self._mixed_precision != "no":
                plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = plugin

    m.AcceleratorState.__init__ = __init__


def _lightning_connector(class_name: str) -> Callable[[ModuleType], None]:
    def patch(m: ModuleType) -> None:
        import torch

        connector = getattr(m, class_name)
        check = connector._check_strategy_and_fallback

        def _check_strategy_and_fallback(self: Any) -> None:
            flag = self._accelerator_flag
            if flag != "cpu" or torch.accelerator.is_available():
                return check(self)
            self._accelerator_flag = "gpu"  # for the GPU-only FSDP check alone
            try:
                check(self)
            finally:
                self._accelerator_flag = flag

        connector._check_strategy_and_fallback = _check_strategy_and_fallback

    return patch


def _patch_torchtitan_utils(m: ModuleType) -> None:
    import torch

    if not torch.accelerator.is_available():
        m.device_type, m.device_module = "cpu", torch.cpu
        m.get_device_info = lambda: ("cpu", torch.cpu)


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "torchtitan.tools.utils": _patch_torchtitan_utils,
    "accelerate.state": _patch_accelerate_state,
    "lightning.fabric.connector": _lightning_connector("_Connector"),
    "lightning.pytorch.trainer.connectors.accelerator_connector": _lightning_connector(
        "_AcceleratorConnector"
    ),
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after its module executes."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def run(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = run  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _AfterImport())
