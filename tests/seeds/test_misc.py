"""Miscellaneous FSDP behaviours: port of torch's ``test/distributed/fsdp/test_fsdp_misc.py``.

Seed ``003_48224c508ae464bb``, on gloo ranks on the CPU (2 ranks; 1 for the world-size-1
test). Ported methods, under the seed's names, with the seed's assertions, messages and
subtests:

- ``test_fsdp_module_no_compute_grad``: ``use_second_layer`` x ``sharding_strategy``
  (NO_SHARD, None), 4 pytest cases; a unit whose output is not used in the loss gets no
  gradient.
- ``test_fsdp_not_all_outputs_used_in_loss``: 3 subtests (FULL_SHARD, SHARD_GRAD_OP,
  NO_SHARD); parity with a local model over 6 steps, the root resharded after backward.
- ``test_fsdp_cpu_training``: FSDP vs DDP over a gloo ``new_group``, Adam, 10 iterations,
  losses equal every iteration; all 5 strategies (7 runs, see below).
- ``test_fsdp_namedtuple``: hooks registered on every tensor of a namedtuple output.
- ``test_homogeneous_attributes``: 3 subtests; mixed values of ``HOMOGENEOUS_ATTR_NAMES``
  raise at the root's lazy initialisation.
- ``test_unsafe_setattr``: 2 subtests (``use_orig_params``); ``FSDP_USE_UNSAFE_SETATTR``
  gates the module's ``__setattr__``.
- ``test_world_size_1_sharding_strategy_warning``: the switch to NO_SHARD on one rank warns.
- ``test_fsdp_same_model_across_ranks``: ``sync_module_states=True`` broadcasts rank 0's
  parameters and buffers.
- ``test_no_params``: FSDP around a module without parameters.
- ``test_fsdp_unsupported_module_cls``: ModuleList/ModuleDict roots warn.

Ported in ``tests/seeds/test_misc_devices.py`` (with CPU versions of their logic): the CUDA-only
and ``device_id`` tests ``test_fsdp_device_id``, ``test_fsdp_cpu_init_stays_on_cpu``,
``test_cpu_init_with_sync_module_states``, ``test_device_id_auto_wrap``,
``test_fsdp_device_id_cpu_offload``, ``test_module_device_mismatches_device_id``,
``test_cpu_gpu_module``, ``test_fsdp_ignored_module_meta``,
``test_fsdp_device_id_no_move_ignored_params_and_bufs``, ``test_multigpu_module``,
``test_training_device_mismatch_errors`` and
``test_fsdp_optim_overlap_no_use_orig_params_error``.

Deviations from the seed, and why:

- CPU and gloo instead of CUDA and NCCL: the suite runs on CPU machines. Modules and inputs
  the seed puts on ``"cuda"`` stay on the CPU; ``device_id="cuda"`` /
  ``torch.cuda.current_device()`` become ``"cpu"`` / ``torch.device("cpu")``. In
  ``test_no_params`` only the CPU cases remain (plain, and with ``device_id``); the two
  CUDA-module cases, one of them the cross-rank ``device_id`` mismatch, belong to the device
  tests. ``test_fsdp_same_model_across_ranks`` runs its two halves on CPU modules (the seed's
  first half uses a CUDA module), without and with ``device_id=torch.device("cpu")``.
- ``test_fsdp_cpu_training``: the seed loops over five strategies but never passes the loop
  variable to FSDP, so torch runs FULL_SHARD five times. Here ``sharding_strategy=ss`` is
  passed, as the test evidently intends. The hybrid strategies need a
  ``(shard_group, replicate_group)`` tuple (torch raises for a single group too), so each is
  run twice: sharded over the 2-rank gloo group and replicated over a 1-rank group, and the
  other way round (sharded over 1 rank, replicated over 2, which exercises the replicate
  all-reduce).
- ``test_fsdp_namedtuple``: beyond the seed (its TODO, blocked on pytorch#83107/#83129 in
  torch): a backward through one output of the namedtuple, then the root's handle must be
  resharded (as ``_check_resharded`` checks) and the input's gradient be right.
- ``_check_resharded`` reads ``untyped_storage().size()`` rather than the deprecated
  ``storage().size()`` (same number for this check: 0, with no TypedStorage warning); our
  handle keeps the padded buffer on ``handle.flat_param._full_param_padded``.
- Environment variables the seed sets for the rest of the process
  (``FSDP_USE_FULL_PREC_IN_EVAL``, ``FSDP_USE_UNSAFE_SETATTR``) are restored in ``finally``
  blocks, since the harness's workers are reused across tests.
- Each rank function starts with ``torch.manual_seed(0)`` where the seed relies on fresh
  processes having the same default RNG state, so that models built "identically" on both
  ranks are (the workers are reused, and earlier tests may seed per rank).
- ``_assert_module_states`` (from torch's common_fsdp) is rewritten below, the same way:
  ``all_gather_object`` of every parameter and buffer, each rank compared with rank 0.
- ``MLP(8, torch.device("cpu"))`` becomes ``MLP(8)``: our ``models.MLP`` takes a seed, not a
  device, as its second argument.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections import namedtuple
from collections.abc import Callable
from copy import deepcopy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fullshard import FullyShardedDataParallel as FSDP
from fullshard import ShardingStrategy
from fullshard._engine.flat_param import _FSDP_USE_UNSAFE_SETATTR, HandleState
from fullshard.fully_sharded_data_parallel import HOMOGENEOUS_ATTR_NAMES
from fullshard.wrap import always_wrap_policy
from harness import run_on_ranks
from models import MLP, NestedWrappedModule
from subtests import run_subtests

WORLD_SIZE = 2
CPU = torch.device("cpu")


class MyModel(nn.Module):
    """The seed's module-level ``MyModel``: two Linear(2, 2) applied to ``x + y``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x + y))


def _restore_env(name: str, saved: str | None) -> None:
    """Put environment variable ``name`` back as it was (``saved`` None: it was unset)."""
    if saved is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = saved


def _check_resharded(fsdp_module: FSDP) -> None:
    """The seed's ``_check_resharded``: the unsharded buffer is freed and ``flat_param`` is
    the local shard."""
    handle = fsdp_module._handle
    if not handle:
        return
    param = handle.flat_param
    if handle.uses_sharded_strategy:
        full_param = param._full_param_padded
        assert full_param.untyped_storage().size() == 0
    assert param.data_ptr() == param._local_shard.data_ptr()


def _assert_module_states(
    model: nn.Module, process_group: Any, assert_fn: Callable[[torch.Tensor, torch.Tensor], None]
) -> None:
    """common_fsdp's ``_assert_module_states``: gather every parameter and buffer from every
    rank and apply ``assert_fn(rank 0's, rank r's)`` for each rank r > 0."""
    named_module_states = [(name, p.detach().cpu()) for name, p in model.named_parameters()]
    named_module_states += [(name, b.detach().cpu()) for name, b in model.named_buffers()]
    assert named_module_states, "nothing to compare"
    world_size = dist.get_world_size(process_group)
    olist: list[Any] = [None for _ in range(world_size)]
    dist.all_gather_object(olist, named_module_states, group=process_group)
    rank0_states = olist[0]
    assert rank0_states is not None
    for state in olist[1:]:
        assert state is not None
        assert len(state) == len(rank0_states)
        for (_, p1), (_, p2) in zip(rank0_states, state):
            assert_fn(p1, p2)


def _assert_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b)


def _assert_not_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert not torch.equal(a, b), f"expected different tensors, both are {a}"


# ----------------------------------------------------------------------------------------
# test_fsdp_module_no_compute_grad


def _fsdp_module_no_compute_grad(
    use_second_layer: bool, sharding_strategy: ShardingStrategy | None
) -> int:
    # When use_second_layer=True, b is involved in forward computation but does
    # not receive grad in backward. Otherwise, b is not involved in forward
    # computation.

    class MyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(10, 10)
            self.b = nn.Linear(10, 10)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
            out1 = self.a(x)
            if use_second_layer:
                out2 = self.b(y)
                return out1, out2
            else:
                return out1

    torch.manual_seed(0)
    fsdp = FSDP(
        MyModel(),
        sharding_strategy=sharding_strategy,
        auto_wrap_policy=always_wrap_policy,
    )
    x = torch.randn(10, 10, device="cpu")
    y = torch.randn(10, 10, device="cpu")
    iterations = 0
    for _ in range(4):
        if use_second_layer:
            a, _b = fsdp(x, y)
        else:
            a = fsdp(x, y)
        loss = a.sum()
        loss.backward()

        # self.a receives grad, self.b does not
        a_grad = fsdp.module.a._handle.flat_param.grad
        b_grad = fsdp.module.b._handle.flat_param.grad
        assert a_grad is not None
        assert b_grad is None
        iterations += 1
    return iterations


@pytest.mark.parametrize("use_second_layer", [True, False])
@pytest.mark.parametrize(
    "sharding_strategy", [ShardingStrategy.NO_SHARD, None], ids=["NO_SHARD", "None"]
)
def test_fsdp_module_no_compute_grad(
    use_second_layer: bool, sharding_strategy: ShardingStrategy | None
) -> None:
    """A unit that takes no part in the loss gets no gradient; the other one does."""
    results = run_on_ranks(
        WORLD_SIZE, _fsdp_module_no_compute_grad, use_second_layer, sharding_strategy
    )
    assert results == [4] * WORLD_SIZE


# ----------------------------------------------------------------------------------------
# test_fsdp_not_all_outputs_used_in_loss


def _test_fsdp_not_all_outputs_used_in_loss(sharding_strategy: ShardingStrategy) -> None:
    class MyModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin1 = nn.Linear(4, 4)
            self.lin2 = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            a = self.lin1(x)
            b = self.lin2(x)
            return (a, b)

    def _check_equal(local: nn.Module, fsdp: FSDP) -> None:
        with FSDP.summon_full_params(fsdp):
            pairs = list(zip(fsdp.parameters(), local.parameters()))
            assert len(pairs) == 4, len(pairs)
            for p1, p2 in pairs:
                torch.testing.assert_close(p1, p2)

    fsdp_ctor = functools.partial(FSDP, sharding_strategy=sharding_strategy)
    torch.manual_seed(0)  # the same module on every rank (FSDP does not sync by default)
    m: Any = MyModule()
    m_local = deepcopy(m)
    local_m = m_local
    prev_params = [p.clone() for p in m_local.parameters()]

    m.lin1 = fsdp_ctor(m.lin1)
    m = fsdp_ctor(m)
    _check_equal(m_local, m)

    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    opt_local = torch.optim.SGD(local_m.parameters(), lr=1e-3)

    for i in range(6):
        t = torch.ones(4, device="cpu")
        a, b = m(t)
        local_a, local_b = local_m(t)
        if i < 2:
            # use both params in loss computation. Later,
            # b will go unused and we check grads are the
            # same as local training.
            loss = (a @ b).sum()
            loss_local = (local_a @ local_b).sum()
        else:
            loss = a.sum()
            loss_local = local_a.sum()

        loss.backward()
        loss_local.backward()
        _check_resharded(m)
        opt.step()
        opt_local.step()
        _check_equal(m_local, m)
        # Ensure at least some change from previous params, otherwise
        # above check would be vacuously true.
        assert any(not torch.equal(p1, p2) for p1, p2 in zip(prev_params, m_local.parameters()))
        prev_params = [p.clone() for p in local_m.parameters()]
        opt.zero_grad()
        opt_local.zero_grad()

    dist.barrier()


def _fsdp_not_all_outputs_used_in_loss() -> int:
    return run_subtests(
        {
            "sharding_strategy": [
                ShardingStrategy.FULL_SHARD,
                ShardingStrategy.SHARD_GRAD_OP,
                ShardingStrategy.NO_SHARD,
            ]
        },
        _test_fsdp_not_all_outputs_used_in_loss,
    )


def test_fsdp_not_all_outputs_used_in_loss() -> None:
    """Training matches a local model when an output stops taking part in the loss, and the
    root is resharded after every backward."""
    assert run_on_ranks(WORLD_SIZE, _fsdp_not_all_outputs_used_in_loss) == [3] * WORLD_SIZE


# ----------------------------------------------------------------------------------------
# test_fsdp_cpu_training


def _fsdp_cpu_training() -> list[str]:
    """Tests FSDP training on CPU."""
    rank = dist.get_rank()
    gloo_pg = dist.new_group(backend="gloo")
    # Every rank creates every 1-rank group, in the same order.
    singletons = [dist.new_group([r], backend="gloo") for r in range(dist.get_world_size())]
    own_pg = singletons[rank]
    configs: list[tuple[ShardingStrategy, Any, str]] = [
        (ShardingStrategy.NO_SHARD, gloo_pg, "gloo_pg"),
        (ShardingStrategy.FULL_SHARD, gloo_pg, "gloo_pg"),
        (ShardingStrategy.SHARD_GRAD_OP, gloo_pg, "gloo_pg"),
    ]
    for ss in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        configs.append((ss, (gloo_pg, own_pg), "shard over 2, replicate over 1"))
        configs.append((ss, (own_pg, gloo_pg), "shard over 1, replicate over 2"))
    ran = []
    for ss, process_group, groups in configs:
        where = f"{ss} ({groups})"
        torch.manual_seed(42)
        model: Any = MyModel()
        ref_model = DDP(deepcopy(model), process_group=gloo_pg)
        model = FSDP(
            model,
            sharding_strategy=ss,
            auto_wrap_policy=always_wrap_policy,
            process_group=process_group,
            device_id=torch.device("cpu"),
        )
        assert model.module.a.sharding_strategy == ss, where
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + rank)
        inp = torch.randn(2, 2)
        for iteration in range(10):
            losses = []
            for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                loss = _model(inp, inp).sum()
                losses.append(loss)
                loss.backward()
                _optim.step()
                _optim.zero_grad()
            torch.testing.assert_close(
                losses[0],
                losses[1],
                msg=lambda m, where=where, i=iteration: f"{where}, iteration {i}: {m}",
            )
        ran.append(where)
    return ran


def test_fsdp_cpu_training() -> None:
    """FSDP on the CPU over a gloo group trains exactly like DDP, with every strategy."""
    results = run_on_ranks(WORLD_SIZE, _fsdp_cpu_training)
    assert len(results[0]) == 7 and results[0] == results[1], results


# ----------------------------------------------------------------------------------------
# test_fsdp_namedtuple


def _fsdp_namedtuple() -> None:
    class MyModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(100, 100)

        def forward(self, x: Any) -> Any:
            return x

    torch.manual_seed(0)
    m = FSDP(MyModule())
    t = torch.ones(1, device="cpu", requires_grad=True)

    MyOutputType = namedtuple("MyOutputType", ["a", "b", "c", "d"], defaults=(t, t, t, t))

    inp = MyOutputType()
    out = m(inp)
    assert isinstance(out, MyOutputType), type(out)
    # Ensure hooks are registered
    for x in out:
        assert list(x._backward_hooks.values()) != []

    # Beyond the seed's TODO (pytorch#83107, #83129): backward through one output, then the
    # parameters are resharded. The root keeps its parameters unsharded between forward
    # and backward (as torch's FSDP does), so the check after backward is not vacuous.
    handle = m._handle
    assert handle is not None
    assert handle.state != HandleState.SHARDED, "the root is unsharded until backward"
    out.a.sum().backward()
    assert handle.state == HandleState.SHARDED, f"root handle still {handle.state} after backward"
    _check_resharded(m)
    torch.testing.assert_close(t.grad, torch.ones(1))
    assert handle.flat_param.grad is None, "the parameters took no part in the output"


def test_fsdp_namedtuple() -> None:
    """Every tensor of a namedtuple output gets FSDP's pre-backward hook; backward through
    one of them reshards the root."""
    run_on_ranks(WORLD_SIZE, _fsdp_namedtuple)


# ----------------------------------------------------------------------------------------
# test_homogeneous_attributes


def _test_homogeneous_attributes(attr_name_and_values: tuple[str, Any, Any]) -> None:
    model: Any = NestedWrappedModule()
    attr_name = attr_name_and_values[0]

    if attr_name == "_use_full_prec_in_eval":
        model.module[1] = FSDP(model.module[1])
        saved = os.environ.get("FSDP_USE_FULL_PREC_IN_EVAL")
        os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1"
        try:
            fsdp_model = FSDP(model)
        finally:
            _restore_env("FSDP_USE_FULL_PREC_IN_EVAL", saved)
    else:
        fsdp_kwargs_inner = {attr_name.lstrip("_"): attr_name_and_values[1]}
        fsdp_kwargs_outer = {attr_name.lstrip("_"): attr_name_and_values[2]}
        model.module[1] = FSDP(model.module[1], **fsdp_kwargs_inner)
        fsdp_model = FSDP(model, **fsdp_kwargs_outer)

    # Run a forward to trigger lazy initialization and the error
    with pytest.raises(ValueError, match=f"Expects one homogeneous value for {attr_name}"):
        inp = fsdp_model.module.get_input(torch.device("cpu"))
        fsdp_model(*inp)


def _homogeneous_attributes() -> int:
    all_attr_name_and_values = [
        ("_use_orig_params", False, True),
        ("limit_all_gathers", False, True),
        ("_use_full_prec_in_eval", False, True),
    ]
    assert [
        attr_name_and_values[0] for attr_name_and_values in all_attr_name_and_values
    ] == HOMOGENEOUS_ATTR_NAMES
    return run_subtests(
        {"attr_name_and_values": all_attr_name_and_values},
        _test_homogeneous_attributes,
    )


def test_homogeneous_attributes() -> None:
    """Tests that passing heterogeneous values for attributes designated as homogeneous
    raises an error."""
    assert run_on_ranks(WORLD_SIZE, _homogeneous_attributes) == [3] * WORLD_SIZE


# ----------------------------------------------------------------------------------------
# test_unsafe_setattr


def _test_unsafe_setattr(use_orig_params: bool) -> None:
    called_setattr_override = False

    class SetattrLinear(nn.Module):
        def __init__(self, in_dim: int, out_dim: int, device: torch.device) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn((in_dim, out_dim), device=device))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight

        def __setattr__(self, name: str, value: Any) -> None:
            nonlocal called_setattr_override
            called_setattr_override = True
            return super().__setattr__(name, value)

    torch.manual_seed(0)
    module = SetattrLinear(5, 5, torch.device("cpu"))
    fsdp_module = FSDP(module, use_orig_params=use_orig_params)
    inp = torch.randn((8, 5), device=torch.device("cpu"))
    called_setattr_override = False
    fsdp_module(inp)
    assert called_setattr_override

    # Repeat with unsafe setattr explicitly enabled
    os.environ[_FSDP_USE_UNSAFE_SETATTR] = "1"
    module = SetattrLinear(5, 5, torch.device("cpu"))
    fsdp_module = FSDP(module, use_orig_params=use_orig_params)
    called_setattr_override = False
    fsdp_module(inp)
    assert not called_setattr_override

    # Repeat with unsafe setattr explicitly disabled
    os.environ[_FSDP_USE_UNSAFE_SETATTR] = "0"
    module = SetattrLinear(5, 5, torch.device("cpu"))
    fsdp_module = FSDP(module, use_orig_params=use_orig_params)
    called_setattr_override = False
    fsdp_module(inp)
    assert called_setattr_override


def _unsafe_setattr() -> int:
    saved = os.environ.get(_FSDP_USE_UNSAFE_SETATTR)
    try:
        return run_subtests({"use_orig_params": [False, True]}, _test_unsafe_setattr)
    finally:
        _restore_env(_FSDP_USE_UNSAFE_SETATTR, saved)


def test_unsafe_setattr() -> None:
    """Tests that the environment variable for using unsafe setattr gates as expected."""
    assert run_on_ranks(WORLD_SIZE, _unsafe_setattr) == [2] * WORLD_SIZE


# ----------------------------------------------------------------------------------------
# test_fsdp_same_model_across_ranks


def _fsdp_same_model_across_ranks() -> None:
    class MyModel(nn.Module):
        def __init__(self, rank: int) -> None:
            super().__init__()
            # Seed via rank to make model different across ranks
            torch.manual_seed(rank)
            self.lin = nn.Linear(10, 10, bias=False)
            self.buffer: torch.Tensor
            self.register_buffer("buffer", torch.ones(1) * rank)

    rank = dist.get_rank()
    process_group = dist.group.WORLD
    for device_id in (None, torch.device("cpu")):
        m = MyModel(rank)
        _assert_module_states(m, process_group=process_group, assert_fn=_assert_not_equal)
        # Passing sync_module_states into FSDP makes model the same during init.
        fsdp = FSDP(m, device_id=device_id, sync_module_states=True)
        with fsdp.summon_full_params(fsdp):
            _assert_module_states(fsdp, process_group=process_group, assert_fn=_assert_equal)
        # Everyone got rank 0's module, not some other agreement.
        expected = MyModel(0)
        with fsdp.summon_full_params(fsdp):
            torch.testing.assert_close(fsdp.module.lin.weight, expected.lin.weight)
        torch.testing.assert_close(fsdp.module.buffer, torch.zeros(1))


def test_fsdp_same_model_across_ranks() -> None:
    """FSDP broadcasts model from rank 0 to ensure it starts off with the same values."""
    run_on_ranks(WORLD_SIZE, _fsdp_same_model_across_ranks)


# ----------------------------------------------------------------------------------------
# test_no_params


def _no_params() -> None:
    x = torch.randn(3, 4)
    # Test CPU
    no_params = nn.ReLU()
    module = FSDP(no_params)
    assert module._handle is None
    torch.testing.assert_close(module(x).cpu(), torch.relu(x))
    # Test CPU + device_id
    no_params = nn.ReLU()
    module = FSDP(no_params, device_id=torch.device("cpu"))
    assert module._handle is None
    out = module(x)
    assert out.device == CPU
    torch.testing.assert_close(out, torch.relu(x))


def test_no_params() -> None:
    """Test that device_id and cpu init work if module has no params (they are effective
    noops, but ensure FSDP does not assume module has parameters during init)."""
    run_on_ranks(WORLD_SIZE, _no_params)


# ----------------------------------------------------------------------------------------
# test_fsdp_unsupported_module_cls


def _fsdp_unsupported_module_cls() -> None:
    regex = r"FSDP will not all-gather parameters for containers that do not implement forward"
    model: nn.Module = nn.ModuleList([MLP(8) for _ in range(3)])
    with pytest.warns(UserWarning, match=regex):
        FSDP(model, device_id="cpu")
    model = nn.ModuleDict({"1": MLP(8), "2": MLP(8)})
    with pytest.warns(UserWarning, match=regex):
        FSDP(model)


def test_fsdp_unsupported_module_cls() -> None:
    """Wrapping a ModuleList or ModuleDict as the root warns: it has no forward to hook."""
    run_on_ranks(WORLD_SIZE, _fsdp_unsupported_module_cls)


# ----------------------------------------------------------------------------------------
# test_world_size_1_sharding_strategy_warning (on a 1-rank pool)


def _world_size_1_sharding_strategy_warning() -> None:
    assert dist.get_world_size() == 1
    warning_prefix = "FSDP is switching to use `NO_SHARD` instead of"
    # If the user already passes `NO_SHARD`, then we should not warn
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")  # trigger all warnings
        FSDP(nn.Linear(3, 3), sharding_strategy=ShardingStrategy.NO_SHARD)
        for warning in w:
            assert warning.category is not UserWarning or not str(warning.message).startswith(
                warning_prefix
            )

    # Check that a warning is issued
    warning_suffix = " since the world size is 1."
    # - Pass `FULL_SHARD` or `None`
    expected_regex_full_shard = (
        warning_prefix + " " + str(ShardingStrategy.FULL_SHARD) + warning_suffix
    )
    with pytest.warns(UserWarning, match=expected_regex_full_shard):
        FSDP(nn.Linear(3, 3), sharding_strategy=ShardingStrategy.FULL_SHARD)
    with pytest.warns(UserWarning, match=expected_regex_full_shard):
        FSDP(nn.Linear(3, 3))
    # - Pass `SHARD_GRAD_OP`
    expected_regex_shard_grad_op = (
        warning_prefix + " " + str(ShardingStrategy.SHARD_GRAD_OP) + warning_suffix
    )
    with pytest.warns(UserWarning, match=expected_regex_shard_grad_op):
        FSDP(nn.Linear(3, 3), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)


def test_world_size_1_sharding_strategy_warning() -> None:
    """Tests that FSDP issues a warning when it switches to using ``NO_SHARD`` when the
    world size is 1."""
    run_on_ranks(1, _world_size_1_sharding_strategy_warning)
