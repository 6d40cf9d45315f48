"""Runs torch's own FSDP1 tests on 2 gloo CPU ranks, against torch's FSDP or fullshard's.

Python imports ``sitecustomize`` at start-up from ``sys.path``; ``run.py`` puts this folder on
PYTHONPATH, so pytest and every rank process it spawns load it. It does nothing unless
``FULLSHARD_TORCH_SUITE`` is ``torch`` (torch's FSDP, the baseline) or ``fullshard``.

It never imports torch itself: an import hook patches each module below right after the module
has run, so the patches are in place before common_fsdp or a test file imports from it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import types

MODE = os.environ.get("FULLSHARD_TORCH_SUITE", "")
WORLD_SIZE = 2
"""The CPU ranks that stand in for GPUs: tests that need more than this still skip."""

_FSDP_PKG = "torch.distributed.fsdp"
_FSDP_HOMES = (_FSDP_PKG, f"{_FSDP_PKG}.api", f"{_FSDP_PKG}.fully_sharded_data_parallel")
"""torch's modules that hold the FSDP1 class and its public config types."""

_FSDP2_NAMES = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
_FSDP2_HOMES = (
    _FSDP_PKG,
    f"{_FSDP_PKG}._fully_shard",
    f"{_FSDP_PKG}._fully_shard._fully_shard",
    f"{_FSDP_PKG}._fully_shard._fsdp_api",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)
"""torch's modules that hold FSDP2's public names (``_composable.fsdp`` is the old path)."""


# --- (a) lift the GPU gating of torch's harness ----------------------------------------------


def _patch_common_distributed(m):
    orig = m.skip_if_lt_x_gpu

    def skip_if_lt_x_gpu(x, *, allow_cpu=False):
        # Run on a CPU-only machine when our ranks cover the GPUs the test asks for.
        return orig(x, allow_cpu=allow_cpu or x <= WORLD_SIZE)

    m.skip_if_lt_x_gpu = skip_if_lt_x_gpu


def _patch_common_device_type(m):
    orig = m.instantiate_device_type_tests

    def instantiate_device_type_tests(*args, **kwargs):
        # The FSDP files pass only_for=("cuda", "hpu", "xpu"): add "cpu" so TestXCPU exists.
        bound = inspect.signature(orig).bind(*args, **kwargs)
        only_for = bound.arguments.get("only_for")
        if only_for is not None:
            only_for = [only_for] if isinstance(only_for, str) else list(only_for)
            bound.arguments["only_for"] = sorted(set(only_for) | {"cpu"})
        return orig(*bound.args, **bound.kwargs)

    m.instantiate_device_type_tests = instantiate_device_type_tests


def _check_ranks(world_size):
    # A test file's world_size property computed from the accelerator count can be 0 on CPU:
    # no rank would run the test, and it would pass. Fail such tests instead.
    if world_size < 1:
        raise RuntimeError(f"world_size is {world_size}: no rank would run this test")
    return world_size


def _patch_common_fsdp(m):
    if (m.DEVICE_TYPE, m.DISTRIBUTED_BACKEND) != ("cpu", "gloo"):
        raise RuntimeError(f"torch_suite expects a CPU-only torch, got {m.DEVICE_TYPE}")
    # world_size defaults to DEVICE_COUNT, which is 1 on CPU.
    m.DEVICE_COUNT = WORLD_SIZE
    m.FSDPTestContinuous.world_size = WORLD_SIZE
    # FSDPTest._run is FSDPTestMixin._run without its `DEVICE_TYPE != "cpu"` guard on the
    # accelerator-count check: use the mixin's copy.
    m.FSDPTest._run = vars(m.FSDPTestMixin)["_run"]

    setup = m.FSDPTest.setUp

    def setUp(self):
        _check_ranks(self.world_size)
        setup(self)

    m.FSDPTest.setUp = setUp

    @classmethod
    def _get_world_size(cls, device_type):
        return _check_ranks(m.MultiProcContinuousTest._get_world_size.__func__(cls, device_type))

    m.FSDPTestContinuous._get_world_size = _get_world_size

    @classmethod
    def _init_pg(cls, rank, world_size, rdvz_file):
        # FSDPTestContinuous._init_pg is the accelerator-count check and set_device, then this.
        super(m.FSDPTestContinuous, cls)._init_pg(rank, world_size, rdvz_file)

    m.FSDPTestContinuous._init_pg = _init_pg

    # --- (c) names the fetched test files import that torch 2.13's harness lacks ---
    if not hasattr(m, "FSDP_DEVICES"):
        # Newer common_fsdp's tuple for only_for (instantiate_device_type_tests adds "cpu").
        m.FSDP_DEVICES = ("cuda", "hpu", "xpu")
    if not hasattr(m, "CUDAInitMode"):
        # Older files' name for DEVICEInitMode (CUDA_BEFORE, ...), passed positionally.
        m.CUDAInitMode = types.SimpleNamespace(
            **{f"CUDA_{e.name[7:]}": e for e in m.DEVICEInitMode}  # DEVICE_BEFORE -> CUDA_BEFORE
        )

    if MODE == "fullshard":
        # A set of torch's ShardingStrategy members that _train_for_several_steps tests
        # `model.sharding_strategy` against: the same members of fullshard's enum.
        from fullshard import ShardingStrategy

        m.NO_RESHARD_AFTER_FORWARD_STRATEGIES = tuple(
            ShardingStrategy[s.name] for s in m.NO_RESHARD_AFTER_FORWARD_STRATEGIES
        )


# --- (b) fullshard mode: torch's public FSDP1 names resolve to fullshard's --------------------

_fsdp_loaded = False


def _swap_fsdp(_module=None):
    """Point every public FSDP1 name in torch's modules at fullshard's class of that name.

    fullshard's config types (ShardingStrategy, MixedPrecision, ...) are its own classes, and
    its FullyShardedDataParallel only takes those, so they are swapped too. Runs once the
    package has finished importing, and again when wrap or sharded_grad_scaler loads later.
    """
    if not _fsdp_loaded:
        return  # a submodule loading while the package itself is still importing
    import fullshard
    import fullshard.sharded_grad_scaler
    import fullshard.wrap

    swaps = [(home, fullshard, set(fullshard.__all__) - {"wrap"}) for home in _FSDP_HOMES]
    swaps.append((f"{_FSDP_PKG}.wrap", fullshard.wrap, fullshard.wrap.__all__))
    swaps.append((f"{_FSDP_PKG}.sharded_grad_scaler", fullshard, ["ShardedGradScaler"]))
    swaps += [(home, fullshard, _FSDP2_NAMES) for home in _FSDP2_HOMES]
    for home, source, names in swaps:
        module = sys.modules.get(home)
        for name in names if module is not None else ():
            if hasattr(module, name):
                setattr(module, name, getattr(source, name))


_swap_pending = False


def _importing(name):
    """Whether module ``name`` is still running its code (an import in progress)."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _fsdp_package_loaded(_module):
    """torch's FSDP package is loaded: swap fullshard's names in, unless torch._dynamo is
    still importing (it imports torch's FSDP; fullshard's decorators need torch._dynamo), in
    which case the swap waits for the next import after it (``_PatchAfterImport``)."""
    global _fsdp_loaded, _swap_pending
    _fsdp_loaded = True
    if _importing("torch._dynamo"):
        _swap_pending = True
        return
    _swap_fsdp()


def _swap_if_pending():
    global _swap_pending
    if _swap_pending and not _importing("torch._dynamo"):
        _swap_pending = False
        _swap_fsdp()


# --- torch mode: torch's FSDP1 picks the CPU where the tests rely on a GPU default ------------


def _torch_fsdp_defaults_to_cpu(_module):
    """Without ``device_id``, torch's FSDP1 computes on its parameters' accelerator device and
    refuses CPU parameters on a host without one ("FSDP needs a non-CPU accelerator device");
    the tests' ``.cuda()`` modules are CPU modules here, so pass ``device_id=cpu`` for them.
    """
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    init = FSDP.__init__
    signature = inspect.signature(init)

    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        if bound.arguments.get("device_id") is None and not torch.accelerator.is_available():
            bound.arguments["device_id"] = torch.device("cpu")
        init(*bound.args, **bound.kwargs)

    FSDP.__init__ = __init__


# --- CPU plumbing of the accelerator calls the FSDP2 tests make (both modes) ------------------


def _cpu_plumbing(torch):
    """What the FSDP2 files call on the accelerator, made to work on a CPU-only host: pinned
    memory (CPUOffloadPolicy pins by default) is the tensor itself, a CPU stream synchronises
    at once, and torch.cpu.device_count() counts the ranks (world sizes are computed from
    it), and the GPU sleep kernel that delays a stream does nothing. Nothing here touches
    an assertion."""
    if torch.accelerator.is_available():
        return
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    torch.Tensor.is_pinned = lambda self, *args, **kwargs: False
    torch.cpu.device_count = lambda: WORLD_SIZE
    stream = getattr(torch.cpu, "Stream", None)
    if stream is not None:
        stream.synchronize = lambda self: None
        stream.wait_stream = lambda self, other: None
    # torch.cuda._sleep(cycles) spins a GPU stream to delay it (the overlap and parity tests
    # use it to shift timing); a CPU has no streams to delay
    torch.cpu._sleep = lambda cycles: None
    _cuda_like_cpu_autocast(torch)


def _cuda_like_cpu_autocast(torch):
    """The tests' DDP references run under ``torch.amp.autocast(DEVICE_TYPE)``, whose default
    dtype is float16 on CUDA (what the tests' FSDP mixed precision uses) but bfloat16 on the
    CPU: make the CPU's default float16 too, as on the GPU the tests were written for."""
    autocast = torch.amp.autocast
    original_init = autocast.__init__

    def __init__(self, device_type, dtype=None, *args, **kwargs):
        if device_type == "cpu" and dtype is None:
            dtype = torch.float16
        original_init(self, device_type, dtype, *args, **kwargs)

    autocast.__init__ = __init__


def _patch_common_utils(module):
    import torch

    _cpu_plumbing(torch)
    if not torch.accelerator.is_available():
        # measured with CUDA events; the cycles only feed _sleep (a no-op here)
        module.get_cycles_per_ms = lambda *args, **kwargs: 1.0


# --- the import hook ---------------------------------------------------------------------------

_PATCHES = {
    "torch.testing._internal.common_distributed": _patch_common_distributed,
    "torch.testing._internal.common_device_type": _patch_common_device_type,
    "torch.testing._internal.common_fsdp": _patch_common_fsdp,
}
if MODE == "torch":
    _PATCHES[_FSDP_PKG] = _torch_fsdp_defaults_to_cpu
if MODE == "fullshard":
    _PATCHES[_FSDP_PKG] = _fsdp_package_loaded
    _PATCHES[f"{_FSDP_PKG}.wrap"] = _swap_fsdp
    _PATCHES[f"{_FSDP_PKG}.sharded_grad_scaler"] = _swap_fsdp
    _PATCHES["torch.distributed._composable.fsdp"] = _swap_fsdp
    _PATCHES["torch.distributed._composable.fsdp.fully_shard"] = _swap_fsdp
_PATCHES["torch.testing._internal.common_utils"] = _patch_common_utils


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds the modules in _PATCHES as usual, and runs their patch after their code."""

    def find_spec(self, name, path, target=None):
        _swap_if_pending()
        patch = _PATCHES.get(name)
        spec = importlib.machinery.PathFinder.find_spec(name, path) if patch else None
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


if MODE in ("torch", "fullshard"):
    sys.meta_path.insert(0, _PatchAfterImport())
elif MODE:
    raise SystemExit(f"FULLSHARD_TORCH_SUITE must be 'torch' or 'fullshard', got {MODE!r}")
