"""fullshard's ``fully_shard`` (torch's FSDP2 API) with torch's and transformers' own tools.

A transformers Llama built from a config (``models.tiny_llama``'s shape, its output
projection tied to the input embedding, random weights, nothing downloaded), sharded as
torchtitan shards one: ``fully_shard`` on each decoder layer, then on the root. On 2 gloo
ranks, each check trains a few AdamW steps on rank-dependent tokens and compares with
torch's own ``fully_shard``, with DDP, or with the same fullshard model without the tool
under test: ``generate`` through ``register_fsdp_forward_method``, activation checkpointing,
``torch.compile`` per layer, and torch's distributed checkpoint API.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from harness import run_on_ranks
from models import input_generator, tiny_llama

pytest.importorskip("transformers")

STEPS = 4
VOCAB = 64
"""tiny_llama's vocabulary."""
TOLERANCE = 1e-5
CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def _tied_llama() -> Any:
    """``tiny_llama`` with ``lm_head.weight`` the embedding's weight, from seed 0 (typed
    ``Any``: its submodules are attributes that nn.Module types as ``Tensor | Module``)."""
    from transformers import LlamaForCausalLM

    config: Any = tiny_llama().config
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    assert config.vocab_size == VOCAB
    assert model.lm_head.weight is model.get_input_embeddings().weight
    return model


def _fully_shard(api: str) -> Callable[..., Any]:
    if api == "fullshard":
        import fullshard

        return fullshard.fully_shard
    import torch.distributed.fsdp

    return torch.distributed.fsdp.fully_shard


def _shard(model: Any, api: str, **kwargs: Any) -> Any:
    """``fully_shard`` on each decoder layer (or what wraps it), then on the root."""
    fully_shard = _fully_shard(api)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _tokens(step: int) -> torch.Tensor:
    """This rank's (2, 12) batch of token ids for ``step``."""
    generator = input_generator(dist.get_rank(), step)
    return torch.randint(0, VOCAB, (2, 12), generator=generator)


def _loss(model: Any, step: int) -> torch.Tensor:
    tokens = _tokens(step)
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = _loss(model, step)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, full, under its name without DDP's or checkpoint_wrapper's prefix."""
    return {
        name.removeprefix("module.").replace(CHECKPOINT_PREFIX, ""): _full(param)
        for name, param in model.named_parameters()
    }


def _assert_same_params(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert list(ours) == list(theirs)
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=TOLERANCE, atol=TOLERANCE, msg=name)


# -- training: parity with torch's fully_shard and with DDP --------------------------------


def _check_training_parity() -> list[float]:
    runs = {}
    for api in ("fullshard", "torch", "ddp"):
        model = _tied_llama()
        sharded = DDP(model) if api == "ddp" else _shard(model, api)
        if api != "ddp":
            embedding = model.get_input_embeddings().weight
            assert model.lm_head.weight is embedding, api  # still one Parameter
            assert isinstance(embedding, DTensor) and isinstance(embedding, nn.Parameter), api
        losses = _train(sharded, _optimizer(sharded), range(STEPS))
        runs[api] = (losses, _full_params(sharded))
    ours, our_params = runs["fullshard"]
    for api in ("torch", "ddp"):
        theirs, their_params = runs[api]
        assert ours == pytest.approx(theirs, rel=TOLERANCE, abs=TOLERANCE), (api, ours, theirs)
        _assert_same_params(our_params, their_params)
    return ours


def test_tied_llama_trains_like_torch_fully_shard_and_ddp() -> None:
    """A Llama with tied embeddings, sharded per decoder layer then at the root: the tied
    weight stays one DTensor Parameter, and 4 AdamW steps give torch's fully_shard's and
    DDP's losses and parameters."""
    losses = run_on_ranks(2, _check_training_parity)
    assert losses[0] != losses[1]  # the ranks saw different tokens


# -- generate through register_fsdp_forward_method ----------------------------------------


def _check_generate() -> list[list[int]]:
    from fullshard import register_fsdp_forward_method

    model = _tied_llama().eval()
    reference = copy.deepcopy(model)
    _shard(model, "fullshard")
    register_fsdp_forward_method(model, "generate")
    prompt = torch.randint(0, VOCAB, (2, 5), generator=input_generator(1, 0))
    # min_new_tokens masks EOS: every rank generates as many tokens, so runs as many forwards
    # (each gathers the parameters).
    settings = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    expected = reference.generate(prompt, **settings)
    generated = model.generate(prompt, **settings)
    assert generated.shape == (2, 11), generated.shape
    assert torch.equal(generated, expected), (generated, expected)
    # Run twice: the first generate left the model ready for the next.
    assert torch.equal(model.generate(prompt, **settings), expected)
    return generated.tolist()


def test_generate_matches_unsharded_model() -> None:
    """Greedy ``generate`` registered with register_fsdp_forward_method gives the unsharded
    model's tokens, on every rank."""
    tokens = run_on_ranks(2, _check_generate)
    assert tokens[0] == tokens[1]


# -- activation checkpointing --------------------------------------------------------------


def _checkpoint_layers(model: Any, impl: str) -> None:
    """``checkpoint_wrapper`` around each decoder layer (fully_shard then shards the
    wrapper), or transformers' own checkpointing inside each layer's forward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if impl == "transformers":
        kwargs = {"use_reentrant": False}
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        return
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
        check_fn=lambda module: isinstance(module, LlamaDecoderLayer),
    )


def _count_mlp_forwards(model: nn.Module) -> list[int]:
    """A one-element counter of the decoder layers' MLP forwards (recomputation included)."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    counter = [0]

    def count(*_: Any) -> None:
        counter[0] += 1

    for module in model.modules():
        if isinstance(module, LlamaMLP):
            module.register_forward_pre_hook(count)
    return counter


def _check_activation_checkpointing(impl: str) -> None:
    plain = _tied_llama().train()
    checkpointed = copy.deepcopy(plain)
    _checkpoint_layers(checkpointed, impl)
    forwards = _count_mlp_forwards(checkpointed)
    num_layers = len(plain.model.layers)
    models = [_shard(plain, "fullshard"), _shard(checkpointed, "fullshard")]
    optims = [_optimizer(model) for model in models]
    for step in range(3):
        losses = []
        for model in models:
            loss = _loss(model, step)
            loss.backward()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=TOLERANCE, abs=TOLERANCE), losses
        grads = [
            {
                name.replace(CHECKPOINT_PREFIX, ""): _full(param.grad)
                for name, param in model.named_parameters()
                if param.grad is not None
            }
            for model in models
        ]
        assert len(grads[0]) == len(list(plain.parameters()))
        _assert_same_params(grads[1], grads[0])
        for optim in optims:
            optim.step()
            optim.zero_grad()
        # Each layer's MLP ran in forward and again in backward's recomputation.
        assert forwards[0] == 2 * num_layers * (step + 1), forwards
    _assert_same_params(_full_params(models[1]), _full_params(models[0]))


@pytest.mark.parametrize("impl", ["checkpoint_wrapper", "transformers"])
def test_activation_checkpointing_matches_no_checkpointing(impl: str) -> None:
    """Non-reentrant activation checkpointing of each decoder layer (torch's
    checkpoint_wrapper applied before fully_shard, or transformers'
    activation_checkpointing_enable): 3 AdamW steps give the losses, gradients and parameters
    of the same sharded model without checkpointing, and the layers were recomputed."""
    run_on_ranks(2, _check_activation_checkpointing, impl)


# -- torch.compile of each layer -----------------------------------------------------------


def _check_compiled_layers() -> tuple[int, int]:
    """The number of graphs dynamo compiled after the first step and after the last."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps them
    eager = _shard(_tied_llama(), "fullshard")
    compiled = _shard(_tied_llama(), "fullshard")
    for layer in compiled.model.layers:
        layer.compile(backend="aot_eager")
    eager_losses = _train(eager, _optimizer(eager), range(STEPS))
    optim = _optimizer(compiled)
    compiled_losses = _train(compiled, optim, range(1))
    graphs_after_first_step = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled_losses += _train(compiled, optim, range(1, STEPS))
    assert compiled_losses == pytest.approx(eager_losses, rel=TOLERANCE, abs=TOLERANCE)
    _assert_same_params(_full_params(compiled), _full_params(eager))
    return graphs_after_first_step, torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_compiled_layers_train_like_eager() -> None:
    """Each decoder layer compiled (aot_eager) after fully_shard: 4 AdamW steps give the
    losses and parameters of the eager sharded model; the layers were compiled in the first
    step and not recompiled after it (their parameters are new tensors every step)."""
    for graphs_after_first_step, graphs in run_on_ranks(2, _check_compiled_layers, timeout=300):
        assert graphs_after_first_step > 0, "nothing was compiled"
        assert graphs == graphs_after_first_step, (graphs_after_first_step, graphs)


# -- torch's distributed checkpoint API ----------------------------------------------------


def _check_checkpoint_resumes(path: str) -> list[float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from fullshard._features.dcp_state_dict import install_when_imported

    # As in a process that built a FullyShardedDataParallel model: torch's state-dict look-ups
    # are replaced, and must leave fully_shard's modules to torch.
    install_when_imported()
    model = _shard(_tied_llama(), "fullshard")
    optim = _optimizer(model)
    _train(model, optim, range(3))
    model_state, optim_state = get_state_dict(model, optim)
    expected_keys = list(_tied_llama().state_dict())  # both names of the tied weight
    assert list(model_state) == expected_keys, (list(model_state), expected_keys)
    torch_model = _shard(_tied_llama(), "torch")
    torch_model_state, _ = get_state_dict(torch_model, _optimizer(torch_model))
    assert list(model_state) == list(torch_model_state)
    assert all(isinstance(value, DTensor) for value in model_state.values())
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    continued = _train(model, optim, range(3, 5))

    resumed_model = _shard(_tied_llama(), "fullshard")
    resumed_optim = _optimizer(resumed_model)
    model_state, optim_state = get_state_dict(resumed_model, resumed_optim)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        resumed_model,
        resumed_optim,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    embedding = resumed_model.get_input_embeddings().weight
    assert resumed_model.lm_head.weight is embedding
    resumed = _train(resumed_model, resumed_optim, range(3, 5))
    assert resumed == pytest.approx(continued, rel=TOLERANCE, abs=TOLERANCE), (resumed, continued)
    return resumed


def test_checkpoint_api_saves_and_resumes(tmp_path: Any) -> None:
    """get_state_dict of the sharded Llama has the unsharded model's keys (the tied weight
    under both names, as torch's fully_shard gives), and dcp.save, then dcp.load and
    set_state_dict into a freshly sharded model, resume to the same next losses."""
    run_on_ranks(2, _check_checkpoint_resumes, str(tmp_path / "checkpoint"))
