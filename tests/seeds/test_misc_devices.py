"""Seed 003 (torch's ``test_fsdp_misc.py``): devices, ``device_id``, and the optimizer in
backward. The rest of seed 003 is ported in ``tests/seeds/test_misc.py``.

Every seed method here needs CUDA (most of them 2 GPUs) to mean what it says, so each is
ported as it is, under ``requires_cuda_gpus`` (skipped with the reason elsewhere):
``test_fsdp_device_id`` (use_index True/False), ``test_fsdp_cpu_init_stays_on_cpu``,
``test_cpu_init_with_sync_module_states``, ``test_device_id_auto_wrap`` (2 subtests),
``test_fsdp_device_id_cpu_offload`` (2 subtests), ``test_module_device_mismatches_device_id``,
``test_cpu_gpu_module``, ``test_fsdp_ignored_module_meta``,
``test_fsdp_device_id_no_move_ignored_params_and_bufs``, ``test_multigpu_module``,
``test_no_params`` (its CUDA half; the CPU half is in test_misc.py),
``test_training_device_mismatch_errors`` (world size 1, 1 GPU). The seed's multi-thread
tests become 2 processes; collectives on CUDA tensors use an NCCL group made in the test.

Their logic also runs here on the CPU, so a machine without GPUs still checks it:

- the device rules themselves (``fullshard._engine.init``: ``compute_device``,
  ``check_single_device``, ``check_on_compute_device``, ``device_from_device_id``) with the
  seed's exact messages, on ``torch.device`` values (which need no GPU to exist);
- the same constructions with ``device_id=torch.device("cpu")`` (auto-wrap propagates it,
  offloaded flat parameters on the CPU, an ignored meta module stays meta);
- the training-time device errors end to end, moving a wrapped module to the meta device
  (the one other device a CPU machine has);
- ``test_fsdp_optim_overlap_no_use_orig_params_error`` and the parity test torch added
  beside it (``test_fsdp_optimizer_overlap``: SGD applied in backward vs a normal step,
  with and without parameter offload), on 2 gloo ranks.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Iterator
from itertools import chain
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_misc import MyModel  # the seed's module-level model
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward

from fullshard import CPUOffload, FlatParameter, ShardingStrategy
from fullshard import FullyShardedDataParallel as FSDP
from fullshard._engine.init import (
    check_on_compute_device,
    check_single_device,
    compute_device,
    device_from_device_id,
)
from fullshard._engine.unit import handles_in as _get_fsdp_handles
from fullshard.wrap import ModuleWrapPolicy, always_wrap_policy, transformer_auto_wrap_policy
from harness import requires_cuda_gpus, run_on_ranks
from models import MLP, NestedWrappedModule, TransformerWithSharedParams, nested_wrap
from subtests import run_subtests

CPU = torch.device("cpu")
META = torch.device("meta")
CUDA0 = torch.device("cuda", 0)
CUDA1 = torch.device("cuda", 1)


# -- the device rules, on device values ------------------------------------------------------


def test_compute_device_rules() -> None:
    """Where a unit computes: its parameters' accelerator, else device_id, else the default;
    device_id must agree (the seed's messages for a module on cuda:1 given device_id=0, with
    and without parameters)."""
    assert compute_device(CUDA1, None, CUDA0, rank=1) == CUDA1
    assert compute_device(CPU, None, CUDA0, rank=0) == CUDA0  # a CPU module: current device
    assert compute_device(CPU, None, CPU, rank=0) == CPU  # no CUDA on this machine
    assert compute_device(CPU, CUDA1, CUDA1, rank=1) == CUDA1
    assert compute_device(CPU, CPU, CUDA0, rank=0) == CPU  # device_id=cpu: train on the CPU
    assert compute_device(None, CPU, CUDA0, rank=0) == CPU
    assert compute_device(None, None, CPU, rank=0) == CPU
    with pytest.raises(ValueError, match="cuda:1 vs cuda:0"):
        compute_device(CUDA1, CUDA0, CUDA1, rank=1)
    with pytest.raises(ValueError, match=r"Inconsistent.*cuda:1 vs cuda:0"):
        compute_device(None, CUDA0, CUDA1, rank=1)  # no parameters: the current device
    with pytest.raises(ValueError, match="Inconsistent compute device and `device_id` on rank 0"):
        compute_device(CUDA0, CPU, CUDA0, rank=0)


def _fake_params(*devices: torch.device) -> list[tuple[str, Any]]:
    # The rule reads only `.device`: stand-ins let a CPU machine check the GPU cases.
    return [(f"p{i}", SimpleNamespace(device=d)) for i, d in enumerate(devices)]


def test_single_device_rule() -> None:
    """CPU + one GPU needs device_id ("please pass in device_id"); two GPUs never work
    ("FSDP only supports single device modules"); the messages name the parameters."""
    check_single_device(_fake_params(CPU, CPU), None, "M")
    check_single_device(_fake_params(CUDA0, CPU), CUDA0, "M")  # CPU ones are then moved
    with pytest.raises(RuntimeError, match="please pass in device_id") as info:
        check_single_device(_fake_params(CUDA0, CPU), None, "M")
    assert "p0: cuda:0" in str(info.value) and "p1: cpu" in str(info.value)
    for device_id in (None, CUDA0):
        with pytest.raises(RuntimeError, match="FSDP only supports single device modules"):
            check_single_device(_fake_params(CUDA0, CUDA1), device_id, "M")


def test_training_device_rule_messages() -> None:
    """The seed's exact texts for a module left on the CPU and for an offloaded one moved."""
    check_on_compute_device(CUDA0, CUDA0, offload_params=False, label="u")
    check_on_compute_device(CPU, CUDA0, offload_params=True, label="u")
    with pytest.raises(
        RuntimeError,
        match=r"An FSDP-managed module unexpectedly has parameters on cpu. Make sure to move "
        r"the module to cuda:0 before training.",
    ):
        check_on_compute_device(CPU, CUDA0, offload_params=False, label="u")
    with pytest.raises(
        RuntimeError,
        match=r"An FSDP-managed module with parameter CPU offloading enabled has parameters on "
        r"cuda:0. Make sure to not move the module from CPU when offloading parameters.",
    ):
        check_on_compute_device(CUDA0, CUDA0, offload_params=True, label="u")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's errors")
def test_device_id_values_without_cuda() -> None:
    """device_id as a torch.device or a str; a CUDA device_id on a machine without CUDA is a
    ValueError that says so (an int names a CUDA device, as in torch)."""
    assert device_from_device_id(None, 0) is None
    assert device_from_device_id(CPU, 0) == CPU
    assert device_from_device_id("cpu", 0) == CPU
    for device_id in (0, "cuda", torch.device("cuda"), CUDA1):
        with pytest.raises(ValueError, match="CUDA is not available"):
            device_from_device_id(device_id, 3)
    with pytest.raises(TypeError, match="device_id must be"):
        device_from_device_id(1.5, 0)  # type: ignore[arg-type]


# -- the same constructions with device_id=cpu, on 2 gloo ranks ----------------------------


def _device_id_auto_wrap(use_callable: bool, device_id: Any) -> None:
    """test_device_id_auto_wrap: every auto-wrapped unit gets device_id's compute device."""
    classes = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}
    policy: Any = (
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes)
        if use_callable
        else ModuleWrapPolicy(classes)
    )
    expected = torch.device("cuda", device_id) if isinstance(device_id, int) else device_id
    model = TransformerWithSharedParams()
    if expected.type == "cuda":
        model = model.cuda()  # the seed's CUDA_BEFORE
    model = FSDP(model, auto_wrap_policy=policy, device_id=device_id)
    units = FSDP.fsdp_modules(model)
    assert len(units) == 5  # the root, 2 encoder and 2 decoder layers
    for unit in units:
        assert unit.compute_device == expected


class _SeqThenLinear(nn.Module):
    """The seed's model for test_fsdp_device_id_cpu_offload: wrapping each nn.Sequential
    gives a nested unit and a parent unit that manages parameters too."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
        self.lin = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.seq(x))


def _device_id_cpu_offload(use_orig_params: bool, device_id: Any, train: bool) -> None:
    """test_fsdp_device_id_cpu_offload: offloaded flat parameters are on the CPU (and, when
    ``train``, so are their gradients after a backward)."""
    fsdp_model = FSDP(
        _SeqThenLinear(),
        auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
        cpu_offload=CPUOffload(offload_params=True),
        device_id=device_id,
        use_orig_params=use_orig_params,
    )
    handles = _get_fsdp_handles(fsdp_model)
    assert len(handles) == 2
    for handle in handles:
        assert handle.flat_param.device == CPU
    if train:
        fsdp_model(torch.randn(3, 10)).sum().backward()
        for handle in handles:
            assert handle.flat_param.grad is not None and handle.flat_param.grad.device == CPU


def _device_id_constructions_cpu() -> tuple[int, int]:
    auto_wrap = run_subtests(
        {"use_callable": [False, True], "device_id": [CPU]}, _device_id_auto_wrap
    )
    offload = run_subtests(
        {"use_orig_params": [False, True], "device_id": [CPU], "train": [True]},
        _device_id_cpu_offload,
    )
    return auto_wrap, offload


def test_device_id_cpu_constructions() -> None:
    """test_device_id_auto_wrap and test_fsdp_device_id_cpu_offload with device_id=cpu: every
    auto-wrapped unit gets the compute device; offloaded flat parameters (and grads) stay on
    the CPU."""
    assert run_on_ranks(2, _device_id_constructions_cpu) == [(2, 2), (2, 2)]


class CPUGPUModule(nn.Module):
    """The seed's two one-unit linears (built on the CPU here)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(1, 1)
        self.b = nn.Linear(1, 1)


def _ignored_module_meta(device_id: Any) -> None:
    with torch.device("meta"):
        m = CPUGPUModule()
    m = FSDP(m, device_id=device_id, ignored_modules=[m.a], use_orig_params=True)
    assert next(m.a.parameters()).device == META
    assert m.b.weight.device != META  # the managed module was materialised
    with torch.device("meta"):
        m = CPUGPUModule()
    m = FSDP(
        m,
        device_id=device_id,
        ignored_modules=[m.a],
        use_orig_params=True,
        param_init_fn=lambda module: module.to_empty(device=device_id, recurse=False),
    )
    assert next(m.a.parameters()).device == META
    assert m.b.weight.device != META


def test_fsdp_ignored_module_meta_cpu() -> None:
    """test_fsdp_ignored_module_meta with device_id=cpu: an ignored meta module stays meta,
    with the default materialisation and with param_init_fn."""
    run_on_ranks(2, _ignored_module_meta, CPU)


def _training_device_errors_cpu() -> None:
    # A CPU machine has no second device to move a module to, so the unit is told it computes
    # on "meta" (as a CPU module's unit on a CUDA machine is told cuda:0): its forward must
    # refuse the CPU shard with the seed's message, and train once the two agree again.
    model = FSDP(nn.Linear(10, 10))
    assert model.compute_device == CPU
    model.compute_device = META
    with pytest.raises(
        RuntimeError,
        match=r"An FSDP-managed module unexpectedly has parameters on cpu. Make sure to move "
        r"the module to meta before training.",
    ):
        model(torch.randn(2, 10))
    model.compute_device = CPU
    model(torch.randn(2, 10)).sum().backward()
    assert model._handle is not None and model._handle.flat_param.grad is not None
    # A move the flat parameter cannot follow in place is refused with a clear error.
    for use_orig_params in (False, True):
        model = FSDP(nn.Linear(10, 10), use_orig_params=use_orig_params)
        with pytest.raises(RuntimeError, match=r"cannot convert FSDP unit .* from cpu to meta"):
            model.to(META)


def test_training_device_mismatch_errors_cpu() -> None:
    """test_training_device_mismatch_errors' check, wired into every unit's forward, on a
    CPU machine (see the comment in the rank function); the offload message is checked on
    device values above and end to end on CUDA."""
    run_on_ranks(1, _training_device_errors_cpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is for CUDA machines")
def test_cpu_module_does_not_warn_without_cuda() -> None:
    """Where CUDA is missing the CPU is the compute device, so wrapping a CPU module does not
    give torch's "passed-in `module` is on CPU" warning (on a CUDA machine it does)."""
    run_on_ranks(1, _wrap_cpu_module_without_warning)


def _wrap_cpu_module_without_warning() -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*passed-in `module` is on CPU")
        model = FSDP(NestedWrappedModule())
    assert model.compute_device == CPU


# -- optimizer in backward (2 gloo ranks) ------------------------------------------------------


def _optim_overlap_no_use_orig_params_error() -> None:
    fsdp_overlap = FSDP(MyModel(), auto_wrap_policy=always_wrap_policy, use_orig_params=False)
    _apply_optimizer_in_backward(
        optimizer_class=torch.optim.SGD,
        params=fsdp_overlap.parameters(),
        optimizer_kwargs={"lr": 0.03},
        register_hook=False,
    )
    inp = torch.randn(10, 2)
    with pytest.raises(RuntimeError, match="only supported with use_orig_params=True"):
        fsdp_overlap(inp, inp)


def test_fsdp_optim_overlap_no_use_orig_params_error() -> None:
    """_apply_optimizer_in_backward on flat parameters: RuntimeError at the first forward."""
    run_on_ranks(2, _optim_overlap_no_use_orig_params_error)


def _optimizer_overlap(cpu_offload: bool, sharding_strategy: ShardingStrategy) -> None:
    torch.manual_seed(0)
    offload = CPUOffload(offload_params=cpu_offload)
    model = MyModel()
    model_overlap = copy.deepcopy(model)
    kwargs: dict[str, Any] = dict(
        auto_wrap_policy=always_wrap_policy,
        use_orig_params=True,
        cpu_offload=offload,
        sharding_strategy=sharding_strategy,
    )
    fsdp = FSDP(model, **kwargs)
    fsdp_overlap = FSDP(model_overlap, **kwargs)
    optim_kwargs = {"lr": 0.03}
    _apply_optimizer_in_backward(
        optimizer_class=torch.optim.SGD,
        params=fsdp_overlap.parameters(),
        optimizer_kwargs=optim_kwargs,
        register_hook=False,
    )
    for p in fsdp_overlap.parameters():
        assert hasattr(p, "_in_backward_optimizers")
    optim = torch.optim.SGD(fsdp.parameters(), **optim_kwargs)
    for p1, p2 in zip(fsdp.parameters(), fsdp_overlap.parameters(), strict=True):
        torch.testing.assert_close(p1, p2, rtol=0, atol=0)
    with FSDP.summon_full_params(fsdp_overlap):
        prev = [(n, p.clone()) for n, p in fsdp_overlap.named_parameters()]
    torch.manual_seed(1 + dist.get_rank())
    for i in range(6):
        inp = torch.randn(2, 2)
        fsdp(inp, inp).sum().backward()
        fsdp_overlap(inp.clone(), inp.clone()).sum().backward()
        optim.step()
        optim.zero_grad()
        # The overlapped optimizer stepped inside backward and freed the sharded gradients.
        for handle in _get_fsdp_handles(fsdp_overlap):
            assert handle.flat_param.grad is None, "Overlapped FSDP sharded_grad is not None!"
        for p in fsdp_overlap.parameters():
            assert p.grad is None
        with FSDP.summon_full_params(fsdp_overlap, with_grads=True):
            for (n, p), (_, p_prev) in zip(fsdp_overlap.named_parameters(), prev, strict=True):
                assert not torch.equal(p, p_prev), f"{n} params at iter {i} same as previous iter!"
        with FSDP.summon_full_params(fsdp_overlap), FSDP.summon_full_params(fsdp):
            for (n_overlap, p_overlap), (n, p) in zip(
                fsdp_overlap.named_parameters(), fsdp.named_parameters(), strict=True
            ):
                assert n_overlap == n
                torch.testing.assert_close(
                    p, p_overlap, msg=f"rank {dist.get_rank()}: {n} differs at iteration {i}"
                )
                assert p.grad is None and p_overlap.grad is None
            prev = [(n, p.clone()) for n, p in fsdp_overlap.named_parameters()]


def test_fsdp_optimizer_overlap() -> None:
    """SGD applied in backward (use_orig_params=True) matches SGD stepped after backward for
    6 iterations, with and without parameter offload, sharded and not: parameters change
    every iteration, no gradient (sharded or original) is left after backward."""
    counts = run_on_ranks(
        2,
        run_subtests,
        {
            "cpu_offload": [False, True],
            "sharding_strategy": [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD],
        },
        _optimizer_overlap,
    )
    assert counts == [4, 4]


# -- CUDA: the seed's methods as written (skipped without the GPUs) ---------------------------


@contextlib.contextmanager
def _on_gpu_of_rank() -> Iterator[None]:
    torch.cuda.set_device(dist.get_rank())
    yield


def _nccl_group() -> Any:
    return dist.new_group(backend="nccl")


def _flat_param_devices(module: nn.Module) -> set[torch.device]:
    devices = {p.device for p in module.parameters() if isinstance(p, FlatParameter)}
    assert len(devices) > 0
    return devices


def _recursive_nwm(fsdp_kwargs: dict[str, Any], cuda_before: bool) -> FSDP:
    """common_fsdp's NestedWrappedModule.init(RECURSIVE, CUDA_BEFORE / CUDA_NEVER)."""
    model = NestedWrappedModule()
    if cuda_before:
        model = model.cuda()
    nested_wrap(model, lambda m: FSDP(m, **fsdp_kwargs))
    return FSDP(model, **fsdp_kwargs)


def _fsdp_device_id(use_index: bool) -> None:
    with _on_gpu_of_rank():
        current = torch.cuda.current_device()
        dev_id: Any = current if use_index else torch.device("cuda", current)
        expected = torch.device("cuda", current)
        for cuda_before in (False, True):  # a CPU module is moved; a GPU one is accepted
            model = _recursive_nwm({"device_id": dev_id}, cuda_before)
            assert _flat_param_devices(model) == {expected}
        with pytest.warns(UserWarning, match="does not have an explicit index"):
            model = _recursive_nwm({"device_id": torch.device("cuda")}, cuda_before=True)
        assert _flat_param_devices(model) == {expected}


@requires_cuda_gpus(2)
@pytest.mark.parametrize("use_index", [True, False])
def test_fsdp_device_id(use_index: bool) -> None:
    run_on_ranks(2, _fsdp_device_id, use_index)


def _cpu_init_stays_on_cpu() -> None:
    with _on_gpu_of_rank():
        pg = _nccl_group()
        with pytest.warns(UserWarning, match="passed-in `module` is on CPU"):
            model = _recursive_nwm({"process_group": pg}, cuda_before=False)
        assert {p.device for p in model.parameters()} == {CPU}
        model = model.cuda()
        inp = model.module.get_input(device=CPU)  # moved to the GPU by the root
        model(*inp).sum().backward()


@requires_cuda_gpus(2)
def test_fsdp_cpu_init_stays_on_cpu() -> None:
    run_on_ranks(2, _cpu_init_stays_on_cpu)


def _cpu_init_with_sync_module_states() -> None:
    with _on_gpu_of_rank():
        pg = _nccl_group()
        rank = dist.get_rank()
        with pytest.raises(
            ValueError,
            match="The module has CPU parameters or buffers when `sync_module_states=True`",
        ):
            FSDP(NestedWrappedModule(), pg, sync_module_states=True)
        model: Any = NestedWrappedModule()
        model.register_buffer("buf", torch.ones((2, 2)) * rank)
        model.module[0].register_buffer("buf", torch.ones((3, 2)) * rank)
        model = FSDP(
            model,
            pg,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            device_id=torch.cuda.current_device(),
            sync_module_states=True,
        )
        device = torch.device("cuda", torch.cuda.current_device())
        assert model.buf.device == device
        torch.testing.assert_close(model.buf, torch.zeros((2, 2), device=device))
        assert model.module.module[0].buf.device == device
        torch.testing.assert_close(model.module.module[0].buf, torch.zeros((3, 2), device=device))


@requires_cuda_gpus(2)
def test_cpu_init_with_sync_module_states() -> None:
    run_on_ranks(2, _cpu_init_with_sync_module_states)


def _multi_thread_cuda_tests() -> None:
    """The seed's TestFSDPMiscMultiThread methods that need 2 GPUs."""
    with _on_gpu_of_rank():
        rank = dist.get_rank()
        current = torch.cuda.current_device()
        auto_wrap = {"use_callable": [False, True], "device_id": [current]}
        assert run_subtests(auto_wrap, _device_id_auto_wrap) == 2
        offload = {"use_orig_params": [False, True], "device_id": [current], "train": [False]}
        assert run_subtests(offload, _device_id_cpu_offload) == 2

        # test_module_device_mismatches_device_id: a module on cuda:1 given device_id=0.
        mismatch = (
            pytest.raises(ValueError, match=f"cuda:{rank} vs cuda:0")
            if rank != 0
            else contextlib.nullcontext()
        )
        with mismatch:
            _recursive_nwm({"device_id": 0}, cuda_before=True)

        # test_cpu_gpu_module
        class CPUGPU(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = nn.Linear(1, 1).cuda()
                self.b = nn.Linear(1, 1)

        fsdp = FSDP(CPUGPU(), device_id=current)
        for param in fsdp.parameters():
            assert param.device == torch.device("cuda", current)
        with pytest.raises(RuntimeError, match="please pass in device_id"):
            FSDP(CPUGPU())

        # test_fsdp_ignored_module_meta
        _ignored_module_meta(current)

        # test_fsdp_device_id_no_move_ignored_params_and_bufs
        m = CPUGPUModule()
        m.a.register_buffer("buf", torch.ones(1))
        m = FSDP(m, device_id=rank, ignored_modules=[m.a], use_orig_params=True)
        for t in chain(m.a.parameters(), m.a.buffers()):
            assert t.device == CPU

        # test_multigpu_module
        class MultiGPU(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = nn.Linear(1, 1).cuda(rank)
                self.b = nn.Linear(1, 1).cuda((rank + 1) % dist.get_world_size())

        with pytest.raises(RuntimeError, match="FSDP only supports single device modules"):
            FSDP(MultiGPU())

        # test_no_params, its CUDA half
        FSDP(nn.ReLU().cuda())
        FSDP(nn.ReLU(), device_id=current)
        no_params = (
            pytest.raises(ValueError, match=f"Inconsistent.*cuda:{rank} vs cuda:0")
            if rank != 0
            else contextlib.nullcontext()
        )
        with no_params:  # NCCL: a CPU module's default compute device is the current GPU
            FSDP(nn.ReLU().cuda(), _nccl_group(), device_id=0)

        # test_fsdp_unsupported_module_cls with device_id="cuda" (no index: warns too)
        with pytest.warns(UserWarning, match="FSDP will not all-gather parameters"):
            FSDP(nn.ModuleList([MLP(8) for _ in range(3)]), device_id="cuda")


@requires_cuda_gpus(2)
def test_device_construction_on_gpus() -> None:
    """test_device_id_auto_wrap (2), test_fsdp_device_id_cpu_offload (2),
    test_module_device_mismatches_device_id, test_cpu_gpu_module,
    test_fsdp_ignored_module_meta, test_fsdp_device_id_no_move_ignored_params_and_bufs,
    test_multigpu_module, test_no_params on 2 GPUs."""
    run_on_ranks(2, _multi_thread_cuda_tests)


def _training_device_mismatch_errors() -> None:
    torch.cuda.set_device(0)
    pg = _nccl_group()  # with gloo alone a CPU module would compute on the CPU
    model = FSDP(nn.Linear(10, 10), pg)  # a CPU module: compute device cuda:0
    with pytest.raises(
        RuntimeError,
        match=r"An FSDP-managed module unexpectedly has parameters on cpu. Make sure to move "
        r"the module to cuda:0 before training.",
    ):
        model(torch.randn((2, 10)))
    model = FSDP(nn.Linear(10, 10), pg, cpu_offload=CPUOffload(offload_params=True))
    model.to(torch.device("cuda"))
    with pytest.raises(
        RuntimeError,
        match=r"An FSDP-managed module with parameter CPU offloading enabled has parameters on "
        r"cuda:0. Make sure to not move the module from CPU when offloading parameters.",
    ):
        model(torch.randn((2, 10)))


@requires_cuda_gpus(1)
def test_training_device_mismatch_errors() -> None:
    run_on_ranks(1, _training_device_mismatch_errors)
