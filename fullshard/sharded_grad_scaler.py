"""``ShardedGradScaler``: dynamic loss scaling when each rank holds only a shard of a gradient.

``torch.amp.GradScaler`` decides on its own rank whether a step overflowed: it looks for
inf/NaN in the gradients that rank can see. Under FSDP a rank sees only its shard of each
gradient, so an overflow in one rank's shard would make that rank alone skip
``optimizer.step()`` and back off its scale, while the others step: the shards of one
parameter would then come from different updates, and the ranks' scales would diverge.
``ShardedGradScaler`` sums the found-inf flags over the process group after unscaling, so
every rank takes the same decision. Two ranks, scale 2.0::

    rank 0: shard grad [2., 4.]  -> unscaled [1., 2.]  local found_inf 0
    rank 1: shard grad [inf, 6.] -> unscaled [inf, 3.] local found_inf 1
    after the all-reduce: found_inf 1 on both -> both skip step(); update() halves both scales

What else differs from ``torch.amp.GradScaler`` (as in torch's FSDP ``ShardedGradScaler``):

- fp16 gradients may be unscaled (FSDP keeps them with ``keep_low_precision_grads`` or an fp16
  model); ``GradScaler`` refuses them.
- ``scale()`` returns each output in its own dtype: a 0-dim fp16 loss times the fp32 scale
  would otherwise promote to fp32.
- Gradients may live on the CPU (parameter offload) while the loss is on an accelerator; CPU
  tensors use torch's CPU kernels, or plain tensor ops where a build lacks a kernel.
"""

from __future__ import annotations

from collections import abc, defaultdict
from collections.abc import Iterable
from typing import Any, overload

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import GradScaler, OptState

from ._comm import collectives as comm

__all__ = ["ShardedGradScaler"]

_LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)


def _fresh_optimizer_state() -> dict[str, Any]:
    """Per-optimizer bookkeeping at the start of an iteration (``GradScaler``'s layout)."""
    return {"stage": OptState.READY, "found_inf_per_device": {}}


class _PerDeviceCopies:
    """One tensor, copied lazily to each device that asks for it (each copy made once)."""

    def __init__(self, master: torch.Tensor) -> None:
        self.master = master
        self.copies: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        copy = self.copies.get(device)
        if copy is None:
            copy = self.master.to(device=device, non_blocking=True, copy=True)
            self.copies[device] = copy
        return copy


# -- kernels, with plain-op fallbacks ---------------------------------------------------------


def _unscale_and_check_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """Multiply ``grads`` in place by ``inv_scale``; set ``found_inf`` to 1 if any of them
    held an inf or NaN. ``grads`` share one device and dtype, as do ``found_inf`` and
    ``inv_scale`` (1-element float32). torch's fused kernel where the device has one."""
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    except NotImplementedError:  # no kernel for this device in this build
        _unscale_and_check_fallback_(grads, found_inf, inv_scale)


def _unscale_and_check_fallback_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """``_unscale_and_check_`` with plain tensor ops (no host sync either).

    As in the kernel, values are checked before the multiplication: a large finite value
    times an ``inv_scale`` above 1 may overflow, and that is not the gradient's fault.
    """
    for grad in grads:
        non_finite = torch.logical_not(torch.isfinite(grad)).any()
        found_inf.copy_(torch.maximum(found_inf, non_finite.to(found_inf.dtype)))
        if grad.dtype in _LOW_PRECISION_DTYPES:
            grad.copy_(grad.to(torch.float32) * inv_scale)  # round once, as the kernel does
        else:
            grad.mul_(inv_scale.to(grad.dtype))


def _update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> None:
    """Back the scale off if ``found_inf`` is nonzero, else grow it every ``growth_interval``
    clean steps (``growth_tracker`` counts them). torch's kernel where the device has one."""
    try:
        torch._amp_update_scale_(
            scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval
        )
    except NotImplementedError:  # no kernel for this device in this build
        _update_scale_fallback_(
            scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval
        )


def _update_scale_fallback_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> None:
    """``_update_scale_`` with plain tensor ops: the kernel's rules, without a host sync.

    Growth that would make the scale non-finite is skipped (the tracker still resets).
    """
    found = found_inf.reshape(()) != 0
    successful = growth_tracker + 1
    interval_reached = successful == growth_interval
    grown = scale * growth_factor
    new_scale = torch.where(
        found,
        scale * backoff_factor,
        torch.where(interval_reached & torch.isfinite(grown), grown, scale),
    )
    new_tracker = torch.where(found | interval_reached, torch.zeros_like(successful), successful)
    scale.copy_(new_scale)
    growth_tracker.copy_(new_tracker)


# -- gradients ------------------------------------------------------------------------------


def _coalesced(grad: torch.Tensor) -> torch.Tensor:
    """A sparse gradient with its duplicate indices summed.

    Unscaling must see the sums: two halves of 2**16 are fine in fp16, their sum is not. Low
    precision values are summed in fp32 and rounded once, so an overflow shows as inf.
    """
    if grad.is_coalesced():
        return grad
    if grad.dtype in _LOW_PRECISION_DTYPES:
        return grad.to(torch.float32).coalesce().to(grad.dtype)
    return grad.coalesce()


def _grads_by_device_and_dtype(
    optimizer: torch.optim.Optimizer, allow_fp16: bool
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """The optimizer's gradients (the values of sparse ones) bucketed for the fused kernel.

    Sparse gradients are replaced by their coalesced form on the parameter (``.grad`` is
    reassigned, as ``GradScaler.unscale_`` documents).
    """
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if not allow_fp16 and grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            if grad.is_sparse:
                grad = _coalesced(grad)
                param.grad = grad
                grad = grad._values()
            buckets[(grad.device, grad.dtype)].append(grad)
    return buckets


# -- the scaler -----------------------------------------------------------------------------


class ShardedGradScaler(GradScaler):
    """``torch.amp.GradScaler`` for sharded gradients: every rank skips or steps alike.

    Use it as ``GradScaler``, with the model wrapped in ``FullyShardedDataParallel``::

        scaler = ShardedGradScaler()
        for inputs, targets in data:
            optim.zero_grad()
            loss = loss_fn(model(inputs), targets)
            scaler.scale(loss).backward()
            scaler.step(optim)  # unscales; skipped on every rank if any rank found inf/NaN
            scaler.update()  # the same new scale on every rank

    Args:
        device: device type of the scaler's state (``"cuda"``, ``"cpu"``, ...). As with
            ``GradScaler``, ``"cuda"`` where CUDA is unavailable warns and disables scaling.
        init_scale: initial scale factor.
        backoff_factor: what the scale is multiplied by after a step with inf/NaN gradients
            (on any rank).
        growth_factor: what the scale is multiplied by after ``growth_interval`` consecutive
            clean steps.
        growth_interval: number of consecutive clean steps between two growths.
        enabled: if False, ``step`` just calls ``optimizer.step()`` and the other methods do
            nothing.
        process_group: the group over which found-inf flags are summed: the ranks that share
            the sharded gradients (the FSDP model's group). None is the default group.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = dist.group.WORLD,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group: dist.ProcessGroup | None = process_group

    # -- scale ---------------------------------------------------------------------------

    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(
        self, outputs: torch.Tensor | Iterable[torch.Tensor]
    ) -> torch.Tensor | Iterable[torch.Tensor]:
        """Multiply ``outputs`` (a tensor, or nested lists/tuples/iterables of tensors) by the
        scale factor; each result keeps its output's dtype. Disabled: ``outputs`` unchanged.

        The scale tensor is created on the first output's device; outputs on other devices
        use one copy per device.
        """
        if not self._enabled:
            return outputs
        scale_copies: dict[torch.device, torch.Tensor] = {}

        def scale_on(device: torch.device) -> torch.Tensor:
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(device)
            assert self._scale is not None
            if device not in scale_copies:
                scale_copies[device] = self._scale.to(device=device, non_blocking=True)
            return scale_copies[device]

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return (value * scale_on(value.device)).to(value.dtype)
            if isinstance(value, (list, tuple)):
                return type(value)(apply(item) for item in value)
            if isinstance(value, abc.Iterable):
                return map(apply, value)
            raise ValueError(
                f"outputs must be a Tensor or an iterable of Tensors, got {type(value).__name__}"
            )

        return apply(outputs)

    # -- unscale -------------------------------------------------------------------------

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale this rank's gradients of ``optimizer`` in place and check them for inf/NaN.

        Returns one found-inf flag per device holding gradients (a copy of ``found_inf``,
        1.0 where some gradient there was not finite); with no gradient at all (a rank
        whose shards are all empty or frozen) one flag on ``found_inf``'s device, so every
        rank has something to contribute to the all-reduce. Local only: no collective.
        """
        inv_scales = _PerDeviceCopies(inv_scale)
        found_infs = _PerDeviceCopies(found_inf)
        with torch.no_grad():
            buckets = _grads_by_device_and_dtype(optimizer, allow_fp16)
            for (device, _), grads in buckets.items():
                _unscale_and_check_(grads, found_infs.get(device), inv_scales.get(device))
        if not found_infs.copies:
            found_infs.get(found_inf.device)
        return found_infs.copies

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale, then agree with the other ranks on
        whether any gradient shard held an inf/NaN (a collective: call it on every rank).

        Optional, as with ``GradScaler``: ``step`` calls it unless it was called already
        this iteration (for example to clip the unscaled gradients first).
        """
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # The reciprocal in fp64 (fp32 division can be inexact under some compile options),
        # except on MPS, which has no fp64.
        if scale.device.type == "mps":
            inv_scale = scale.reciprocal()
        else:
            inv_scale = scale.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        found_inf_per_device = self._unscale_grads_(
            optimizer, inv_scale, found_inf, allow_fp16=True
        )
        self._all_reduce_found_inf(found_inf_per_device)
        state["found_inf_per_device"] = found_inf_per_device
        state["stage"] = OptState.UNSCALED

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The check ``step`` runs for optimizers that unscale in their own fused kernel
        (``_step_supports_amp_scaling``), agreed over the ranks like ``unscale_``'s."""
        found_inf_per_device = super()._check_inf_per_device(optimizer)
        self._all_reduce_found_inf(found_inf_per_device)
        return found_inf_per_device

    def _all_reduce_found_inf(self, found_inf_per_device: dict[Any, torch.Tensor]) -> None:
        """Sum the found-inf flags over the process group, in place: after this each of this
        rank's flags holds the number of flags set on all ranks (> 0: skip everywhere).

        The flags of all devices are summed into one tensor first, so every rank issues
        exactly one all-reduce: the devices holding gradients may differ between ranks (a
        rank with no gradient has only the scale's device), and per-device collectives
        would then pair up wrongly or hang. It is issued asynchronously and waited on at
        once: ``step`` needs the answer before it can decide.
        """
        group = self.process_group
        if group is None:
            if not dist.is_initialized():
                return  # a single process: nothing to agree with
            group = dist.group.WORLD
            assert group is not None
        device = self._communication_device()
        total = torch.zeros((), dtype=torch.float32, device=device)
        for flag in found_inf_per_device.values():
            total += flag.to(device).sum()
        comm.all_reduce(total, group, "found_inf").wait()
        for flag in found_inf_per_device.values():
            flag.copy_(total.to(flag.device))

    def _communication_device(self) -> torch.device:
        """Where the found-inf all-reduce runs: the accelerator when there is one (NCCL takes
        no CPU tensors), even if the flags are on the CPU because of parameter offload."""
        if self._scale is not None and self._scale.device.type != "cpu":
            return self._scale.device
        return torch.device(self._device)

    # -- update --------------------------------------------------------------------------

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back the scale off if any rank found inf/NaN this iteration, else count a clean
        step (growing the scale every ``growth_interval``); or set ``new_scale``.

        Call it once per iteration, after ``step`` for every optimizer. The flags it reads
        were already agreed over the ranks, so every rank computes the same new scale.
        """
        if not self._enabled:
            return
        if new_scale is not None:
            super().update(new_scale)
            return
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        flags = [
            flag.to(scale.device).sum()
            for state in self._per_optimizer_states.values()
            for flag in state["found_inf_per_device"].values()
        ]
        if not flags:
            raise AssertionError("No inf checks were recorded prior to update.")
        found_inf = torch.stack(flags).sum()
        _update_scale_(
            scale,
            growth_tracker,
            found_inf,
            self._growth_factor,
            self._backoff_factor,
            self._growth_interval,
        )
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
