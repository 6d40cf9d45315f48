"""Train a model under FSDP alongside the same model under DDP, and compare them.

Call :func:`check_ddp_parity` inside a function run by ``harness.run_on_ranks``: it needs
the default process group. Both models are built from the same seed, see the same
rank-dependent inputs, and must produce the same loss at every step and the same
parameters at the end (gathered with ``summon_full_params``).

Note on the optimizer: Adam (the default) divides each update by the gradient's running
RMS, so a gradient off by a constant factor (say, averaged over ranks twice) trains the
same. Pass ``optim_cls=torch.optim.SGD`` where gradient scale is what a test checks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ["check_ddp_parity"]

LossFn = Callable[[tuple[Tensor, ...], Tensor], Tensor]
InputFn = Callable[[int, int], tuple[Tensor, ...]]


def check_ddp_parity(
    model_fn: Callable[[], nn.Module],
    fsdp_fn: Callable[[nn.Module], nn.Module],
    num_steps: int = 5,
    lr: float = 1e-2,
    optim_cls: Callable[..., torch.optim.Optimizer] = torch.optim.Adam,
    rtol: float = 1e-5,
    atol: float = 1e-5,
    grad_accum: int | None = None,
    *,
    use_no_sync: bool = True,
    seed: int = 0,
    loss_fn: LossFn | None = None,
    input_fn: InputFn | None = None,
    optim_kwargs: dict[str, Any] | None = None,
    ddp_kwargs: dict[str, Any] | None = None,
    fsdp_cls: type[nn.Module] | None = None,
    device: torch.device | str = "cpu",
) -> list[float]:
    """Train ``fsdp_fn(model_fn())`` and ``DDP(model_fn())`` side by side; assert parity.

    Args:
        model_fn: builds the unwrapped model; called twice, each time after
            ``torch.manual_seed(seed)``, and must give identical models.
        fsdp_fn: wraps a fresh model for the run under test (nesting by hand, auto wrap
            policy, strategy, ... are its business).
        grad_accum: if set, each step runs this many micro-batches before ``optim.step``;
            all but the last run under ``no_sync()`` unless ``use_no_sync`` is False.
        loss_fn: ``loss_fn(input, output)``; defaults to the model's ``get_loss``.
        input_fn: ``input_fn(rank, index)``; defaults to the model's
            ``get_input(device, rank=rank, step=index)``, index counting micro-batches.
        fsdp_cls: the FSDP class whose ``summon_full_params`` gathers the parameters;
            defaults to ``fullshard.FullyShardedDataParallel`` (imported only then, so
            this routine can check torch's FSDP too).

    Returns:
        This rank's loss at each step (summed over micro-batches), for further checks.
    """
    if fsdp_cls is None:
        import fullshard

        fsdp_cls = fullshard.FullyShardedDataParallel
    rank = dist.get_rank()
    ref_local, fsdp_local = _build_identical_models(model_fn, seed, device)
    ref = DDP(ref_local, **(ddp_kwargs or {}))
    fsdp = fsdp_fn(fsdp_local)
    ref_optim = optim_cls(ref.parameters(), lr=lr, **(optim_kwargs or {}))
    fsdp_optim = optim_cls(fsdp.parameters(), lr=lr, **(optim_kwargs or {}))
    loss_of = loss_fn or _model_method(ref_local, "get_loss")
    inputs_of = input_fn or _default_input_fn(ref_local, device)
    num_micro = grad_accum or 1
    step_losses = []
    for step in range(num_steps):
        inputs = [inputs_of(rank, step * num_micro + i) for i in range(num_micro)]
        ref_losses = _train_step(ref, ref_optim, inputs, loss_of, use_no_sync)
        fsdp_losses = _train_step(fsdp, fsdp_optim, inputs, loss_of, use_no_sync)
        for micro, (fsdp_loss, ref_loss) in enumerate(zip(fsdp_losses, ref_losses, strict=True)):
            where = f"rank {rank} step {step} micro-batch {micro}: loss differs from DDP's"
            _assert_close(fsdp_loss, ref_loss, rtol, atol, where)
        step_losses.append(sum(loss.item() for loss in fsdp_losses))
    _assert_params_match(fsdp, ref.module, fsdp_cls, rtol, atol, rank)
    return step_losses


def _build_identical_models(
    model_fn: Callable[[], nn.Module], seed: int, device: torch.device | str
) -> tuple[nn.Module, nn.Module]:
    """Two constructions of the model from the same seed; raise if they differ."""
    models = []
    for _ in range(2):
        torch.manual_seed(seed)
        models.append(model_fn().to(device))
    first, second = (m.state_dict() for m in models)
    for fqn, tensor in first.items():
        if not torch.equal(tensor, second[fqn]):
            raise ValueError(
                f"model_fn built two different models from seed {seed} (first difference "
                f"at {fqn!r}); make its initialisation depend only on the global seed"
            )
    return models[0], models[1]


def _model_method(model: nn.Module, name: str) -> Callable[..., Any]:
    """``model.name``, or a ValueError saying which argument to pass instead."""
    method = getattr(model, name, None)
    if not callable(method):
        what = "loss_fn" if name == "get_loss" else "input_fn"
        raise ValueError(f"{type(model).__name__} has no {name}(); pass {what}")
    return method


def _default_input_fn(model: nn.Module, device: torch.device | str) -> InputFn:
    """Inputs from the model's ``get_input(device, rank=..., step=...)``."""
    get_input = _model_method(model, "get_input")

    def inputs_of(rank: int, index: int) -> tuple[Tensor, ...]:
        inputs = get_input(device, rank=rank, step=index)
        return inputs if isinstance(inputs, tuple) else (inputs,)

    return inputs_of


def _train_step(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    micro_inputs: list[tuple[Tensor, ...]],
    loss_of: LossFn,
    use_no_sync: bool,
) -> list[Tensor]:
    """Forward/backward every micro-batch, then step and zero grads; return the losses."""
    losses = []
    for i, inputs in enumerate(micro_inputs):
        last = i == len(micro_inputs) - 1
        with _maybe_no_sync(model, enabled=use_no_sync and not last):
            output = model(*inputs)
            loss = loss_of(inputs, output)
            loss.backward()
        losses.append(loss.detach())
    optim.step()
    optim.zero_grad(set_to_none=True)
    return losses


@contextlib.contextmanager
def _maybe_no_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """``model.no_sync()`` when enabled (DDP and FSDP roots both have it)."""
    if not enabled:
        yield
        return
    no_sync = getattr(model, "no_sync", None)
    if no_sync is None:
        raise ValueError(
            f"{type(model).__name__} has no no_sync(); wrap the root or pass use_no_sync=False"
        )
    with no_sync():
        yield


def _assert_params_match(
    fsdp: nn.Module,
    ref: nn.Module,
    fsdp_cls: type[nn.Module],
    rtol: float,
    atol: float,
    rank: int,
) -> None:
    """Gather FSDP's full parameters and compare names and values with the reference."""
    summon = getattr(fsdp_cls, "summon_full_params")  # noqa: B009 (not on nn.Module's type)
    with summon(fsdp):
        fsdp_named = [(fqn, p.detach().clone()) for fqn, p in fsdp.named_parameters()]
    ref_named = list(ref.named_parameters())
    fsdp_fqns = [fqn for fqn, _ in fsdp_named]
    ref_fqns = [fqn for fqn, _ in ref_named]
    assert fsdp_fqns == ref_fqns, (
        f"rank {rank}: parameter names under summon_full_params differ from the local "
        f"model's\n  fsdp: {fsdp_fqns}\n  ref:  {ref_fqns}"
    )
    for (fqn, fsdp_param), (_, ref_param) in zip(fsdp_named, ref_named, strict=True):
        where = f"rank {rank}: parameter {fqn} differs from DDP's"
        _assert_close(fsdp_param, ref_param.detach(), rtol, atol, where)


def _assert_close(actual: Tensor, expected: Tensor, rtol: float, atol: float, where: str) -> None:
    """``torch.testing.assert_close`` with ``where`` (rank, step, name) leading the message."""
    torch.testing.assert_close(
        actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{where}\n{m}"
    )
