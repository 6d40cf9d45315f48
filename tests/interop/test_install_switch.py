"""The install switch (issue 31): torch's FSDP names resolve to fullshard's, through
``fullshard.install()`` or ``FULLSHARD_INSTALL=1`` at interpreter start (the
``fullshard-install.pth`` file the package installs), in every process a launcher starts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness import run_on_ranks

_HOMES_CHECK = textwrap.dedent(
    """
    import logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    import torch.distributed.fsdp as fsdp
    import torch.distributed._composable.fsdp as old_path
    from torch.distributed.fsdp import wrap, sharded_grad_scaler, api
    from torch.distributed.fsdp._fully_shard import _fully_shard, _fsdp_api
    import fullshard, fullshard.wrap
    checks = {
        "fsdp.fully_shard": fsdp.fully_shard is fullshard.fully_shard,
        "fsdp.FSDPModule": fsdp.FSDPModule is fullshard.FSDPModule,
        "fsdp.FullyShardedDataParallel": fsdp.FullyShardedDataParallel
        is fullshard.FullyShardedDataParallel,
        "fsdp.MixedPrecisionPolicy": fsdp.MixedPrecisionPolicy is fullshard.MixedPrecisionPolicy,
        "api.ShardingStrategy": api.ShardingStrategy is fullshard.ShardingStrategy,
        "wrap.ModuleWrapPolicy": wrap.ModuleWrapPolicy is fullshard.wrap.ModuleWrapPolicy,
        "sharded_grad_scaler": sharded_grad_scaler.ShardedGradScaler
        is fullshard.ShardedGradScaler,
        "_fully_shard.fully_shard": _fully_shard.fully_shard is fullshard.fully_shard,
        "_fsdp_api.CPUOffloadPolicy": _fsdp_api.CPUOffloadPolicy is fullshard.CPUOffloadPolicy,
        "old_path.fully_shard": old_path.fully_shard is fullshard.fully_shard,
    }
    print(sorted(name for name, ok in checks.items() if not ok))
    """
)


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_fullshard_install_env_var_swaps_every_home_at_startup() -> None:
    """``FULLSHARD_INSTALL=1``: a fresh interpreter that imports torch's FSDP modules (as a
    stack does) finds fullshard's names in every one of them, and the process logs it once;
    without the variable, torch's names stay."""
    on = _python(_HOMES_CHECK, {"FULLSHARD_INSTALL": "1"})
    assert on.returncode == 0, on.stderr
    lines = on.stdout.splitlines()
    assert lines[-1] == "[]", on.stdout  # no home left with torch's name
    assert sum("fullshard serves torch.distributed.fsdp" in line for line in lines) == 1
    # the start-up hook imports no torch (a launcher's own process pays nothing for it)
    bare = _python("import sys; print('torch' in sys.modules)", {"FULLSHARD_INSTALL": "1"})
    assert bare.stdout.strip() == "False", bare.stdout + bare.stderr
    off = _python(_HOMES_CHECK, {"FULLSHARD_INSTALL": "0"})
    assert off.returncode == 0, off.stderr
    assert "fsdp.fully_shard" in off.stdout.splitlines()[-1]


def test_the_pth_file_is_installed_beside_the_package() -> None:
    """The switch's start-up hook sits in site-packages (the README's install puts it there)."""
    import site

    import fullshard

    places = [Path(p) for p in site.getsitepackages()]
    assert any((place / "fullshard-install.pth").exists() for place in places), places
    assert Path(fullshard.__file__).exists()


def _install_in_python() -> None:
    import warnings

    import torch
    from torch import nn
    from torch.distributed.fsdp import FSDPModule as torch_fsdp_module

    import fullshard
    from fullshard import _install

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fullshard.install()
        fullshard.install()  # idempotent, and torch 2.13 warns of nothing
    from torch.distributed.fsdp import fully_shard

    assert fully_shard is fullshard.fully_shard
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0])
    fully_shard(model)
    # torch's class, bound before the switch, still recognises fullshard's modules
    assert isinstance(model, torch_fsdp_module) and isinstance(model, fullshard.FSDPModule)
    assert isinstance(model[0], torch_fsdp_module)
    assert type(model).__mro__[type(model)._orig_cls_mro_index] is nn.Sequential
    # torch's class comes last, behind nn.Module: none of its methods runs through super()
    # (its _apply asks for torch's FSDP state; Lightning moves modules with .to())
    assert type(model).__mro__[-2:] == (torch_fsdp_module, object)
    model.to(torch.device("cpu"))
    loss = model(torch.randn(3, 4)).sum()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    sliced = model[:1]  # containers index themselves into plain modules of their class
    assert type(sliced) is nn.Sequential
    with pytest.warns(UserWarning, match="not a release fullshard's switch is tested with"):
        old = _install.TESTED_TORCH
        _install.TESTED_TORCH = ((1, 0),)
        try:
            _install._check_torch_version()
        finally:
            _install.TESTED_TORCH = old


def test_install_in_python_swaps_names_and_keeps_isinstance_of_early_bound_classes() -> None:
    run_on_ranks(2, _install_in_python)


@pytest.mark.parametrize("api", ["fully_shard", "FullyShardedDataParallel"])
def test_torchrun_with_fullshard_install_trains_on_fullshard(api: str, tmp_path: Path) -> None:
    """``FULLSHARD_INSTALL=1 torchrun ...``: an unmodified script that imports torch's FSDP
    trains on fullshard's units (their class, and fullshard's collectives counted) in both
    ranks, to DDP's losses."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import copy
            import torch, torch.distributed as dist
            from torch import nn
            from torch.distributed.fsdp import fully_shard, FullyShardedDataParallel
            from torch.nn.parallel import DistributedDataParallel as DDP
            dist.init_process_group("gloo")
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
            ref = DDP(copy.deepcopy(model))
            if "{api}" == "fully_shard":
                fully_shard(model[0]); fully_shard(model); wrapped = model
            else:
                wrapped = FullyShardedDataParallel(model)
            from fullshard._comm.collectives import COUNTERS
            losses = []
            for net in (wrapped, ref):
                opt = torch.optim.SGD(net.parameters(), lr=0.1)
                run = []
                for step in range(3):
                    g = torch.Generator().manual_seed(10 * step + dist.get_rank())
                    loss = net(torch.randn(4, 6, generator=g)).pow(2).mean()
                    loss.backward(); opt.step(); opt.zero_grad(); run.append(loss.item())
                losses.append(run)
            assert type(wrapped).__module__.startswith("fullshard"), type(wrapped).__mro__
            assert COUNTERS.calls["all_gather"] > 0, dict(COUNTERS.calls)
            assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(*losses)), losses
            with open(f"{tmp_path}/rank{{dist.get_rank()}}.txt", "w") as out:
                out.write(type(wrapped).__module__)
            dist.barrier()
            dist.destroy_process_group()
            # leave without interpreter finalization, where a gloo thread may abort the
            # process (torch's pytorch/pytorch#179291; tests/stacks/scripts/report.py)
            import os, sys
            sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
            """
        )
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
        ],
        env={**os.environ, "FULLSHARD_INSTALL": "1", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text().startswith("fullshard.")
