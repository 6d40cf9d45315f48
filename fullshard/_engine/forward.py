"""A unit's forward, around the module's own: lazy initialisation of the root, devices,
precision casts, and the runtime's pre/post-forward hooks (unshard, reshard).

Front doors call ``before_forward`` and ``after_forward`` around the module's forward (or
one of its forward methods, such as ``generate``); only that call is compiled under
torch.compile (see [Note: torch.compile runs the wrapper eagerly] in ``compile``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import init
from .autograd_graph import iter_tensors, map_tensors
from .compile import eager
from .flat_param import HandleState
from .names import clean_fqn
from .runtime import TrainingState
from .settings import check_homogeneous
from .step import RootState
from .unit import Unit, unit_of, units_in

__all__: list[str] = []


def lazy_init(root: Unit) -> None:
    """Make ``root`` the root of every unit below it (at its first forward)."""
    units: list[tuple[str, Unit]] = []
    for name, m in root.fsdp_module.named_modules():
        unit = unit_of(m)
        if unit is not None and all(unit is not seen for _, seen in units):
            fqn = clean_fqn(name) or "(root)"  # a group's unit named by its first module
            units.extend((fqn, each) for each in (unit, *unit.siblings))
    check_homogeneous([unit.settings for _, unit in units])
    for fqn, unit in units:
        if unit is not root and unit.runtime.training_state != TrainingState.IDLE:
            raise RuntimeError(f"FSDP unit '{fqn}' is in use while its root initialises")
        unit.runtime.is_root = unit is root
        unit.runtime.beside_root = unit.sibling_of is root  # the root's rule, for its groups
        if unit.handle is not None:
            unit.handle.label = f"{fqn} [{unit.tag}]" if unit.tag else fqn
            unit.handle.adopt_replaced_data()
            unit.handle.init_optimizers_in_backward()
        unit.managed_buffers = (
            []  # the buffers are the unit's it is a sibling of
            if unit.sibling_of is not None
            else [
                (module, name, buffer.dtype)
                for module in unit.managed_modules()
                for name, buffer in module._buffers.items()
                if buffer is not None and buffer.is_floating_point()
            ]
        )
    root_state = RootState(
        [unit.runtime for _, unit in units],
        root.settings.backward_prefetch,
        root.settings.forward_prefetch,
        root.settings.switches.reductions_in_flight,
    )
    for _, unit in units:
        unit.runtime.root_state = root_state


def is_root(unit: Unit) -> bool:
    """Whether ``unit`` is the root (initialising lazily if needed)."""
    if unit.runtime.is_root is None:
        lazy_init(unit)
    return bool(unit.runtime.is_root)


@eager
def before_forward(
    unit: Unit, args: Any, kwargs: Any, training: bool
) -> tuple[Any, Any, torch.dtype | None]:
    """Lazy init, device checks, input casts and the pre-forward hook (unshard).

    Returns the inputs to run with and, for classes that upcast under mixed precision, the
    dtype to cast the output back to."""
    runtime = unit.runtime
    if runtime.is_root is None:
        lazy_init(unit)
    full_precision = unit.forces_full_precision()
    if unit.handle is not None:
        unit.handle.materialize_assigned_params()
        init.check_on_compute_device(
            unit.handle.flat_param.device,
            unit.compute_device,
            unit.handle.offload_params,
            unit.label,
        )
    if runtime.is_root:
        args, kwargs = _to_compute_device(unit.compute_device, args, kwargs)
        _cast_buffers(unit, full_precision)
    args, kwargs = cast_inputs(unit, args, kwargs)
    input_dtype = None
    if unit.upcasts_for_class:
        input_dtype = _first_floating_dtype((args, kwargs))
        args, kwargs = cast_floating(torch.float32, (args, kwargs))
    runtime.pre_forward(full_precision, training=training)
    return args, kwargs, input_dtype


@eager
def after_forward(unit: Unit, output: Any, input_dtype: torch.dtype | None, inputs: Any) -> Any:
    """The post-forward hook (reshard, backward hooks on the outputs and ``inputs``)."""
    if input_dtype is not None:
        output = cast_floating(input_dtype, output)
    return unit.runtime.post_forward(output, inputs)


def cast_inputs(unit: Unit, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """The inputs in the policy's ``param_dtype`` where it casts them. Also each later
    module of a group (``fully_shard([a, b])``), as torch 2.13 casts every module's.

    torch's FSDP1 casts in two hooks: the root's (``cast_root_forward_inputs``) and every
    unit's own (``cast_forward_inputs``, only for a unit with parameters), so a root with
    parameters casts if either flag is set. ``fully_shard`` casts every module's inputs by
    its policy's one flag (the engine's two are set alike), parameters or not."""
    mixed_precision = unit.mixed_precision
    if mixed_precision is None or mixed_precision.param_dtype is None:
        return args, kwargs
    if unit.forces_full_precision():
        return args, kwargs
    fully_shard = unit.settings.mp_policy is not None
    cast = mixed_precision.cast_forward_inputs and (fully_shard or unit.handle is not None)
    if unit.runtime.is_root:
        cast = cast or mixed_precision.cast_root_forward_inputs
    if not cast:
        return args, kwargs
    return cast_floating(mixed_precision.param_dtype, (args, kwargs))


def forward_in_summon(unit: Unit, fn: Any, args: Any, kwargs: Any) -> Any:
    """Inside ``summon_full_params`` (generation code runs the inner model there): the
    module already sees its full parameters, so ``fn`` (the module or one of its forward
    methods) computes with them, in their own dtype, and the unit's state is left to the
    summon. Under no_grad: gradients of the summoned parameters would be dropped when the
    summon ends, so a backward through this output raises instead."""
    if not unit.runtime.exposes_full_params:
        raise RuntimeError(
            f"forward of FSDP unit '{unit.label}' inside summon_full_params(rank0_only=True)"
            f" on rank {dist.get_rank()}, which does not hold the full parameters; run the "
            "forward on rank 0 only, or summon with rank0_only=False"
        )
    with torch.no_grad():
        return fn(*args, **kwargs)


def _cast_buffers(root: Unit, full_precision: bool) -> None:
    """Root only: buffers in ``buffer_dtype`` for compute, or their own dtype in full
    precision eval. Cast only when the mode changes (the first forward included)."""
    root_state = root.runtime.root
    if root_state.buffers_full_precision == full_precision:
        return
    root_state.buffers_full_precision = full_precision
    for unit in units_in(root.fsdp_module):
        mixed_precision = unit.mixed_precision
        buffer_dtype = mixed_precision.buffer_dtype if mixed_precision is not None else None
        for module, name, orig_dtype in unit.managed_buffers:
            buffer = module._buffers[name]
            dtype = orig_dtype if full_precision or buffer_dtype is None else buffer_dtype
            if buffer is not None and buffer.dtype != dtype:
                buffer.data = buffer.data.to(dtype)


def _to_compute_device(device: torch.device, args: Any, kwargs: Any) -> tuple[Any, Any]:
    def move(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.device == device else tensor.to(device)

    return map_tensors(move, args), map_tensors(move, kwargs)


def cast_floating(dtype: torch.dtype, obj: Any) -> Any:
    """Cast every floating-point tensor inside ``obj`` (nested containers) to ``dtype``."""

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point() or tensor.dtype == dtype:
            return tensor
        return tensor.to(dtype)

    return map_tensors(cast, obj)


def _first_floating_dtype(obj: Any) -> torch.dtype | None:
    for tensor in iter_tensors(obj):
        if tensor.is_floating_point():
            return tensor.dtype
    return None


class UnshardWork:
    """What an explicit, asynchronous unshard returns: ``wait()`` waits for the all-gather."""

    def __init__(self, unit: Unit) -> None:
        self._unit: Unit | None = unit

    def wait(self) -> None:
        unit, self._unit = self._unit, None
        handle = unit.handle if unit is not None else None
        if handle is not None and handle.state == HandleState.UNSHARDING:
            handle.wait_unshard()


def unshard(unit: Unit) -> UnshardWork:
    """Issue the unit's all-gather now (an explicit prefetch, outside forward/backward): its
    own forward then finds the parameters gathered."""
    handle = unit.handle
    if handle is not None and handle.state == HandleState.SHARDED:
        handle.unshard(unit.forces_full_precision())
    return UnshardWork(unit)
