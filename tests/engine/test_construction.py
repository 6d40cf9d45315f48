"""Construction options: sync_module_states, ignored modules and states, meta-device init.

The seed-003 ports of these live with the rest of issue 4's work; these tests pin the
behaviour on 2 gloo ranks on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fullshard import FullyShardedDataParallel as FSDP
from fullshard.wrap import ModuleWrapPolicy
from harness import run_on_ranks
from models import NestedWrappedModule, nested_wrap


def _gathered(tensor: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor.contiguous())
    return out


class _WithBuffers(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(rank)
        self.inner = nn.Sequential(nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 3))
        self.running: torch.Tensor
        self.register_buffer("running", torch.full((2,), float(rank)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + self.running.sum()


def _sync_module_states(auto_wrap: bool) -> None:
    rank = dist.get_rank()
    expected = _WithBuffers(0).state_dict()  # what rank 0 builds
    model = _WithBuffers(rank)
    assert not torch.equal(model.inner[0].weight, expected["inner.0.weight"]) or rank == 0
    policy = ModuleWrapPolicy({nn.Linear}) if auto_wrap else None
    fsdp = FSDP(model, sync_module_states=True, auto_wrap_policy=policy, use_orig_params=True)
    with FSDP.summon_full_params(fsdp):
        state = {name: p.detach().clone() for name, p in fsdp.named_parameters()}
    state.update((name.replace("_fsdp_wrapped_module.", ""), b) for name, b in fsdp.named_buffers())
    assert state.keys() == expected.keys()
    for name, value in state.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
        others = _gathered(value)
        assert all(torch.equal(o, others[0]) for o in others), name


@pytest.mark.parametrize("auto_wrap", [False, True])
def test_sync_module_states_broadcasts_rank0(auto_wrap: bool) -> None:
    """Ranks built differently end up with rank 0's parameters and buffers."""
    run_on_ranks(2, _sync_module_states, auto_wrap)


class _TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.a.register_buffer("buf", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _ignored_modules(use_ignored_states: bool) -> None:
    torch.manual_seed(0)
    module = _TwoLinears()
    a_weight = module.a.weight
    kwargs = (
        {"ignored_states": [module.a]} if use_ignored_states else {"ignored_modules": [module.a]}
    )
    fsdp = FSDP(module, **kwargs)
    handle = fsdp._handle
    assert handle is not None
    assert handle.param_fqns == ["b.weight", "b.bias"], handle.param_fqns
    assert module.a.weight is a_weight and a_weight.shape == (3, 3), "left alone"
    names = [n for n, _ in fsdp.named_parameters()]
    assert "_fsdp_wrapped_module.a.weight" in names, names
    fsdp(torch.randn(2, 3)).sum().backward()
    assert a_weight.grad is not None and a_weight.grad.shape == (3, 3), "local, unreduced"


@pytest.mark.parametrize("use_ignored_states", [False, True])
def test_ignored_modules_are_left_unmanaged(use_ignored_states: bool) -> None:
    """Ignored modules' parameters stay as they are (not flattened, sharded or reduced)."""
    run_on_ranks(2, _ignored_modules, use_ignored_states)


def _ignored_meta_and_param_init_fn() -> None:
    with torch.device("meta"):
        module = _TwoLinears()
    fsdp = FSDP(module, ignored_modules=[module.a], use_orig_params=True)
    assert module.a.weight.is_meta, "an ignored meta module stays meta"
    assert not module.b.weight.is_meta, "managed modules are materialised"
    assert module.a.buf.is_meta
    del fsdp

    calls: list[str] = []

    def init_fn(m: nn.Module) -> None:
        calls.append(type(m).__name__)
        m.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            for p in m.parameters(recurse=False):
                p.fill_(0.5)

    with torch.device("meta"):
        module = _TwoLinears()
    fsdp = FSDP(module, ignored_modules=[module.a], param_init_fn=init_fn, use_orig_params=True)
    assert calls == ["Linear"], "called once, on the one managed module with meta params"
    assert module.a.weight.is_meta
    with FSDP.summon_full_params(fsdp):
        assert bool((module.b.weight == 0.5).all())


def test_meta_init_with_ignored_modules_and_param_init_fn() -> None:
    """Meta modules are materialised (reset_parameters or param_init_fn); ignored stay meta."""
    run_on_ranks(2, _ignored_meta_and_param_init_fn)


def _meta_init_trains_like_cpu_init() -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    reference = NestedWrappedModule()
    with torch.device("meta"):
        model = NestedWrappedModule()
    torch.manual_seed(0)  # reset_parameters replays the same draws as the constructor
    nested_wrap(model, lambda m: FSDP(m))
    fsdp = FSDP(model, sync_module_states=True)
    with FSDP.summon_full_params(fsdp):
        for (name, p), q in zip(fsdp.named_parameters(), reference.parameters()):
            assert not p.is_meta, name
            assert p.shape == q.shape, name
    (x,) = reference.get_input("cpu", rank)
    loss = fsdp(x).sum()
    loss.backward()
    assert torch.isfinite(loss)


def test_meta_device_model_materialises_and_trains() -> None:
    """A model built on the meta device gets real parameters from reset_parameters()."""
    run_on_ranks(2, _meta_init_trains_like_cpu_init)


def _construction_errors() -> None:
    lin = nn.Linear(2, 2)
    with pytest.raises(
        ValueError, match="Cannot pass both ignored_modules and ignored_states at the same time"
    ):
        FSDP(nn.Sequential(lin), ignored_modules=[lin], ignored_states=[lin])
    with pytest.raises(
        ValueError,  # torch's text: the distinct types, sorted by repr
        match=r"ignored_states expects all nn\.Parameter or all nn\.Module list elements but "
        r"got types \[<class 'torch\.nn\.modules\.linear\.Linear'>, "
        r"<class 'torch\.nn\.parameter\.Parameter'>\]",
    ):
        FSDP(nn.Sequential(lin), ignored_states=[lin.weight, lin, lin.bias])
    with pytest.raises(
        ValueError,
        match=r"ignored_modules expects nn\.Module list elements but got types "
        r"\[<class 'torch\.nn\.parameter\.Parameter'>\]",
    ):
        FSDP(nn.Sequential(lin), ignored_modules=[lin.weight, lin.bias])
    with pytest.warns(UserWarning, match="Trying to ignore the top-level module passed into"):
        model = nn.Sequential(nn.Linear(2, 2))
        FSDP(model, ignored_modules=[model])
    with pytest.raises(ValueError, match="to be callable"):
        FSDP(nn.Sequential(lin), param_init_fn=3)  # type: ignore[arg-type]


def test_construction_errors_name_the_problem() -> None:
    """Conflicting or mistyped ignored/param_init_fn options raise with torch's messages."""
    run_on_ranks(2, _construction_errors)


def _containers_without_forward() -> None:
    regex = "FSDP will not all-gather parameters for containers that do not implement forward"
    with pytest.warns(UserWarning, match=regex):
        FSDP(nn.ModuleList([nn.Linear(8, 8) for _ in range(3)]))
    with pytest.warns(UserWarning, match=regex):
        FSDP(nn.ModuleDict({"1": nn.Linear(8, 8), "2": nn.Linear(8, 8)}))


def test_module_list_and_dict_warn() -> None:
    """Seed 003's test_fsdp_unsupported_module_cls: ModuleList/ModuleDict roots warn."""
    run_on_ranks(2, _containers_without_forward)
