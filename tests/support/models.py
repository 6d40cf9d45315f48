"""Small test models, our own versions of those in torch's ``common_fsdp.py``.

Every model builds its parameters deterministically from ``seed`` (the constructor calls
``torch.manual_seed(seed)``, as common_fsdp does), so two constructions on any rank are
identical. ``get_input(device, rank, step)`` draws from a private generator seeded by
(rank, step): each rank gets different data, as in data parallel training, and the global
RNG is left alone. ``get_loss(input, output)`` reduces the output to a scalar.

Shapes follow common_fsdp so ported tests keep their numbers:

- :class:`NestedWrappedModule`: Linear(8,4) -> [Linear(4,16) -> Linear(16,16)] ->
  Linear(16,4) -> Linear(4,8); by hand, common_fsdp wraps ``module.1.0``, ``module.1``
  and ``module.2`` (see :func:`nested_wrap`).
- :class:`NonUniformReqGradNWM`: the same, but the last two linears share a container
  ``module.2`` in which only ``module.2.1`` is trainable.
- :class:`LoRAStack`: a frozen base (input projection, blocks of two linears, head weight)
  with trainable low-rank adapters beside each block linear and a trainable head bias, so
  every unit of ``ModuleWrapPolicy({LoRABlock})`` mixes frozen and trainable parameters.
- :class:`TransformerWithSharedParams`: embedding (vocab 23, d_model 16) into a 2+2 layer
  ``nn.Transformer``; the output projection's weight is the embedding's weight.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from fullshard import ShardingStrategy
from fullshard._comm.groups import _default_hybrid_groups

__all__ = [
    "HYBRID_STRATEGY_NAMES",
    "MLP",
    "STRATEGIES",
    "STRATEGY_NAMES",
    "DummyProcessGroup",
    "LinearBlock",
    "LoRABlock",
    "LoRAStack",
    "NestedWrappedModule",
    "NonUniformReqGradNWM",
    "ParityModel",
    "TransformerWithSharedParams",
    "input_generator",
    "nested_wrap",
    "strategy_kwargs",
    "tiny_llama",
    "transformer_layer_classes",
]

STRATEGIES = [
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
]
"""The strategies over one process group (the hybrid ones need a second: HYBRID_STRATEGY_NAMES)."""
STRATEGY_NAMES = [strategy.name for strategy in STRATEGIES]
HYBRID_STRATEGY_NAMES = ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]


def strategy_kwargs(strategy: str) -> dict[str, Any]:
    """FSDP1 options for wrapping by hand with ``strategy`` (a ShardingStrategy name): the
    hybrid strategies also get explicit node-local (shard, replicate) groups (within
    LOCAL_WORLD_SIZE ranks, made once per default group and local size), since a
    hand-wrapped hybrid unit without them is refused (as by torch)."""
    kwargs: dict[str, Any] = {"sharding_strategy": ShardingStrategy[strategy]}
    if strategy in HYBRID_STRATEGY_NAMES:  # the groups an auto_wrap_policy would get
        kwargs["process_group"] = _default_hybrid_groups()
    return kwargs


class LinearBlock(nn.Module):
    """``relu(lin(x))``, dim -> dim: the block of the schedule and fault tests' stacks."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.lin(x))


def input_generator(rank: int, step: int) -> torch.Generator:
    """A CPU generator seeded from (rank, step): data differs per rank and per step."""
    return torch.Generator().manual_seed(1 + rank + 65_536 * step)


class ParityModel(nn.Module):
    """The interface the parity routine uses: inputs per (rank, step) and a scalar loss."""

    def get_input(
        self, device: torch.device | str, rank: int = 0, step: int = 0
    ) -> tuple[Tensor, ...]:
        """Positional inputs for ``forward`` for this rank and step, on ``device``."""
        raise NotImplementedError

    def get_loss(self, input: tuple[Tensor, ...], output: Tensor) -> Tensor:
        """A scalar loss from the inputs and the forward output."""
        return output.sum()


class NestedWrappedModule(ParityModel):
    """Four linears, two of them in an inner ``nn.Sequential``: the classic nesting test."""

    WRAP_TARGET_FQNS: tuple[str, ...] = ("module.1.0", "module.1", "module.2")
    """Children common_fsdp wraps by hand, inner before outer (the order to wrap in)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.module = nn.Sequential(
            nn.Linear(8, 4),
            nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16)),
            nn.Linear(16, 4),
            nn.Linear(4, 8),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.module(x)  # (4, 8) -> (4, 8)

    def get_input(
        self, device: torch.device | str, rank: int = 0, step: int = 0
    ) -> tuple[Tensor, ...]:
        """One (4, 8) batch of uniform noise."""
        return (torch.rand(4, 8, generator=input_generator(rank, step)).to(device),)

    def wrap_targets(self) -> list[nn.Module]:
        """The submodules common_fsdp wraps by hand, inner before outer."""
        return [self.get_submodule(fqn) for fqn in self.WRAP_TARGET_FQNS]


def nested_wrap(model: NestedWrappedModule, wrap_fn: Callable[[nn.Module], nn.Module]) -> None:
    """Replace each of ``model``'s wrap targets by ``wrap_fn(target)``, inner first.

    With ``wrap_fn = FSDP`` this builds common_fsdp's "RECURSIVE" NestedWrappedModule; the
    root itself is left for the caller to wrap (or not).
    """
    for fqn in model.WRAP_TARGET_FQNS:
        parent_fqn, _, name = fqn.rpartition(".")
        parent = model.get_submodule(parent_fqn)
        setattr(parent, name, wrap_fn(getattr(parent, name)))


class NonUniformReqGradNWM(NestedWrappedModule):
    """A NestedWrappedModule whose wrap unit ``module.2`` mixes frozen and trainable params.

    Only ``module.2.1`` (the last linear) requires grad; ``module.2.0`` beside it and every
    other parameter are frozen. With two ranks the trainable params can land on one rank
    only, which exercises ranks with no trainable shard.
    """

    def __init__(self, seed: int = 0) -> None:
        nn.Module.__init__(self)
        torch.manual_seed(seed)
        self.module = nn.Sequential(
            nn.Linear(8, 4),
            nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16)),
            nn.Sequential(nn.Linear(16, 4), nn.Linear(4, 8)),
        )
        for param in self.parameters():
            param.requires_grad_(False)
        self.module.get_submodule("2.1").requires_grad_(True)


class LoRALinear(nn.Module):
    """A frozen linear plus a trainable low-rank update: ``base(x) + up(down(x))``.

    Both adapter matrices start random (LoRA starts ``up`` at zero), so every adapter
    parameter has a nonzero gradient from the first step.
    """

    def __init__(self, dim_in: int, dim_out: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(dim_in, dim_out)
        self.down = nn.Linear(dim_in, rank, bias=False)
        self.up = nn.Linear(rank, dim_out, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.up(self.down(x))  # (B, dim_out)


class LoRABlock(nn.Module):
    """A residual MLP block over LoRA linears with a frozen LayerNorm."""

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = LoRALinear(dim, 2 * dim, rank)
        self.fc2 = LoRALinear(2 * dim, dim, rank)
        self.norm.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))  # (B, dim)


class LoRAStack(ParityModel):
    """Frozen input projection, ``num_blocks`` LoRA blocks, and a head whose weight is frozen
    and bias trainable: the root unit mixes frozen and trainable parameters too."""

    def __init__(self, seed: int = 0, dim: int = 7, rank: int = 3, num_blocks: int = 2) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.dim = dim
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.Sequential(*(LoRABlock(dim, rank) for _ in range(num_blocks)))
        self.head = nn.Linear(dim, dim)
        self.inp.requires_grad_(False)
        self.head.weight.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.inp(x)))  # (4, dim)

    def get_input(
        self, device: torch.device | str, rank: int = 0, step: int = 0
    ) -> tuple[Tensor, ...]:
        """One (4, dim) batch of normal noise."""
        return (torch.randn(4, self.dim, generator=input_generator(rank, step)).to(device),)

    def get_loss(self, input: tuple[Tensor, ...], output: Tensor) -> Tensor:
        return (output**2).mean()


def transformer_layer_classes() -> set[type[nn.Module]]:
    """The layer classes to give ``ModuleWrapPolicy`` for TransformerWithSharedParams."""
    return {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}


class TransformerWithSharedParams(ParityModel):
    """A tiny encoder-decoder transformer with tied input embedding and output projection.

    Dropout is 0 and, like common_fsdp's deterministic mode, the model starts in eval mode
    (BatchNorm then uses its running statistics), so every run is reproducible.
    """

    VOCAB = 23
    D_MODEL = 16
    BATCH = 2

    def __init__(self, seed: int = 0, add_bn: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed_tokens = nn.Embedding(self.VOCAB, self.D_MODEL)
        with warnings.catch_warnings():
            # "enable_nested_tensor is True, but ... batch_first was not True": an inference
            # fast path we do not use; sequence-first layout is what common_fsdp uses.
            warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
            self.transformer = nn.Transformer(
                d_model=self.D_MODEL,
                nhead=2,
                num_encoder_layers=2,
                num_decoder_layers=2,
                dim_feedforward=8,
                dropout=0.0,
            )
        self.output_proj = nn.Linear(self.D_MODEL, self.VOCAB)
        self.output_proj.weight = self.embed_tokens.weight  # tied: one parameter, two users
        self.vocab_bias: Tensor
        self.long_buffer: Tensor
        self.register_buffer("vocab_bias", torch.ones(self.D_MODEL))
        self.register_buffer("long_buffer", torch.zeros(self.D_MODEL, dtype=torch.long))
        self.bn: nn.Module = nn.BatchNorm1d(self.BATCH) if add_bn else nn.Identity()
        self.eval()

    def forward(self, src_ids: Tensor, tgt_ids: Tensor) -> Tensor:
        src = self.embed_tokens(src_ids)  # (S, B, C)
        src = src + self.vocab_bias + self.long_buffer.type_as(src)
        tgt = self.bn(self.embed_tokens(tgt_ids))  # (T, B, C)
        return self.output_proj(self.transformer(src, tgt))  # (T, B, VOCAB)

    def get_input(
        self, device: torch.device | str, rank: int = 0, step: int = 0
    ) -> tuple[Tensor, ...]:
        """Token ids ``src`` (6, 2) and ``tgt`` (4, 2), sequence first."""
        gen = input_generator(rank, step)
        src = torch.randint(self.VOCAB, (6, self.BATCH), generator=gen)
        tgt = torch.randint(self.VOCAB, (4, self.BATCH), generator=gen)
        return (src.to(device), tgt.to(device))

    def get_loss(self, input: tuple[Tensor, ...], output: Tensor) -> Tensor:
        """Summed cross entropy of predicting ``tgt`` from the output logits."""
        _, tgt = input
        logits = output.view(-1, output.size(-1))  # (T * B, VOCAB)
        return nn.functional.cross_entropy(logits, tgt.view(-1), reduction="sum")

    def get_ignored_modules(self) -> list[nn.Module]:
        """The modules common_fsdp's ignored-modules tests leave out of FSDP."""
        return [self.transformer]


class MLP(ParityModel):
    """in_proj -> relu -> out_proj, with an optional buffer added to the output."""

    def __init__(
        self,
        dim: int,
        seed: int = 0,
        *,
        bias: bool = True,
        with_buffer: bool = False,
        dim_multiplier: int = 4,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.dim = dim
        self.in_proj = nn.Linear(dim, dim_multiplier * dim, bias=bias)
        self.out_proj = nn.Linear(dim_multiplier * dim, dim, bias=bias)
        self.buffer: Tensor | None
        if with_buffer:
            self.register_buffer("buffer", torch.randn(dim))
        else:
            self.buffer = None

    def forward(self, x: Tensor) -> Tensor:
        z = self.out_proj(nn.functional.relu(self.in_proj(x)))  # (B, dim)
        return z if self.buffer is None else z + self.buffer

    def get_input(
        self, device: torch.device | str, rank: int = 0, step: int = 0
    ) -> tuple[Tensor, ...]:
        """One (2, dim) batch of normal noise."""
        return (torch.randn(2, self.dim, generator=input_generator(rank, step)).to(device),)


class _CompletedWork:
    """A finished collective: ``wait`` returns at once, the future is already set."""

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[int]:
        future: torch.futures.Future[int] = torch.futures.Future()
        future.set_result(1)
        return future


class DummyProcessGroup:
    """A stand-in process group: a rank, a size, and collectives that do nothing.

    For unit tests of code that only asks a group its rank and size, or issues a
    collective whose result does not matter, without initialising torch.distributed.
    """

    def __init__(self, rank: int, size: int) -> None:
        self._rank = rank
        self._size = size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def allreduce(self, *args: object, **kwargs: object) -> _CompletedWork:
        """Do nothing and return a completed work (the tensors are left unchanged)."""
        return _CompletedWork()

    allgather = allreduce
    broadcast = allreduce
    reduce_scatter = allreduce
    barrier = allreduce
    _allgather_base = allreduce
    _reduce_scatter_base = allreduce


def tiny_llama() -> nn.Module:
    """A transformers Llama built from a config (random weights, nothing downloaded): 2
    decoder layers of width 32, a 64-token vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)
