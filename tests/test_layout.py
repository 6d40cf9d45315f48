"""Layout math and state enums: pure functions, no process group."""

from __future__ import annotations

import pytest
import torch

from fullshard._layout import make_layout, padded_numel
from fullshard._process_groups import gradient_divide_factors
from fullshard._runtime import HandleTrainingState, TrainingState, map_tensors
from fullshard.flat_param import HandleState


@pytest.mark.parametrize(
    "numel,num_shards,expected", [(0, 2, 0), (7, 1, 7), (7, 2, 8), (7, 3, 9), (9, 3, 9)]
)
def test_padded_numel_rounds_up_to_multiple_of_shards(
    numel: int, num_shards: int, expected: int
) -> None:
    """Padding makes the flat buffer split evenly."""
    assert padded_numel(numel, num_shards) == expected


def test_layout_docstring_example_three_ranks() -> None:
    """Parameters of 3 and 4 elements on 3 ranks split as the module docstring shows."""
    layout = make_layout(["a", "b"], [torch.Size([3]), torch.Size([2, 2])], [True, True], 3)
    assert (layout.numel, layout.padded_numel, layout.shard_numel) == (7, 9, 3)
    assert [s.offset for s in layout.slots] == [0, 3]
    rank0, rank1, rank2 = (layout.shard_pieces(r) for r in range(3))
    assert rank0[0] is not None and (rank0[0].param_start, rank0[0].numel) == (0, 3)
    assert rank0[1] is None
    assert rank1[0] is None
    assert rank1[1] is not None and (
        rank1[1].param_start,
        rank1[1].shard_start,
        rank1[1].numel,
    ) == (0, 0, 3)
    assert rank2[1] is not None and (rank2[1].param_start, rank2[1].numel) == (3, 1)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 5])
def test_shard_pieces_cover_every_element_once(num_shards: int) -> None:
    """Across ranks, the pieces of each parameter tile it exactly."""
    shapes = [torch.Size(s) for s in [(5, 3), (7,), (1,), (2, 2, 2)]]
    layout = make_layout([str(i) for i in range(4)], shapes, [True] * 4, num_shards)
    covered = [torch.zeros(s.numel(), dtype=torch.int64) for s in shapes]
    for rank in range(num_shards):
        for piece in layout.shard_pieces(rank):
            if piece is not None:
                covered[piece.slot_index][piece.param_start : piece.param_start + piece.numel] += 1
                assert (
                    piece.shard_start >= 0 and piece.shard_start + piece.numel <= layout.shard_numel
                )
    assert all(bool((c == 1).all()) for c in covered)


def test_shard_range_rejects_out_of_range_rank() -> None:
    """Asking for a rank outside the shard group is an error, not an empty shard."""
    layout = make_layout(["w"], [torch.Size([4])], [True], 2)
    with pytest.raises(ValueError, match="out of range"):
        layout.shard_range(2)


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 8, 16, 6])
def test_gradient_divide_factors_multiply_to_world(num_ranks: int) -> None:
    """The pre- and post-division factors together average over every rank."""
    pre, post = gradient_divide_factors(num_ranks)
    assert pre * post == pytest.approx(num_ranks)
    assert pre >= 1 and post >= 1


def test_state_enums_document_every_value() -> None:
    """Every state-machine value carries a docstring (the design's rule)."""
    for enum_cls in (HandleState, TrainingState, HandleTrainingState):
        source = __import__("inspect").getsource(enum_cls)
        for member in enum_cls:
            after = source.split(f"{member.name} = enum.auto()", 1)[1].lstrip()
            assert after.startswith('"""'), f"{enum_cls.__name__}.{member.name} has no docstring"


def test_map_tensors_keeps_container_types() -> None:
    """Inputs moved to the compute device keep their namedtuple/dict/list structure."""
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")
    data = {"x": [torch.ones(1), (Pair(torch.zeros(1), 3),)]}
    mapped = map_tensors(lambda t: t + 1, data)
    assert isinstance(mapped["x"][1][0], Pair) and mapped["x"][1][0].b == 3
    assert mapped["x"][0].item() == 2 and mapped["x"][1][0].a.item() == 1
