"""Layout math and state enums: pure functions, no process group."""

from __future__ import annotations

import pytest
import torch

from fullshard._comm.groups import gradient_divide_factors
from fullshard._engine.autograd_graph import map_tensors
from fullshard._engine.flat_param import HandleState
from fullshard._engine.layout import make_layout, make_unit_layout, padded_numel
from fullshard._engine.runtime import HandleTrainingState, TrainingState


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


def test_unit_layout_docstring_example_splits_trainable_and_frozen() -> None:
    """a (3, trainable), b (4, frozen), c (2, trainable) on 2 ranks: UnitLayout's example."""
    shapes = [torch.Size([3]), torch.Size([2, 2]), torch.Size([2])]
    layout = make_unit_layout(["a", "b", "c"], shapes, [True, False, True], 2)
    trainable, frozen = layout.segments
    assert [s.fqn for s in trainable.slots] == ["a", "c"]
    assert (trainable.numel, trainable.padded_numel, trainable.shard_numel) == (5, 6, 3)
    assert [s.fqn for s in frozen.slots] == ["b"] and not frozen.slots[0].requires_grad
    assert (frozen.numel, frozen.padded_numel) == (4, 4)
    assert layout.locations == ((0, 0), (1, 0), (0, 1))
    assert layout.slot(2).offset == 3 and layout.param_indices(0) == [0, 2]
    rank1 = trainable.shard_pieces(1)  # [c0 c1 pad]
    assert rank1[0] is None and rank1[1] is not None
    assert (rank1[1].param_start, rank1[1].shard_start, rank1[1].numel) == (0, 0, 2)


@pytest.mark.parametrize("requires_grad", [True, False])
def test_unit_layout_of_uniform_params_is_one_flat_layout(requires_grad: bool) -> None:
    """All trainable or all frozen: one segment, exactly ``make_layout``'s."""
    shapes = [torch.Size([3]), torch.Size([2, 2])]
    flags = [requires_grad] * 2
    layout = make_unit_layout(["a", "b"], shapes, flags, 3)
    assert layout.segments == (make_layout(["a", "b"], shapes, flags, 3),)
    assert layout.locations == ((0, 0), (0, 1))


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


# -- FSDP2's dim-0 layout -------------------------------------------------------------------


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_dim0_layout_splits_like_torch_chunk(num_shards: int) -> None:
    """Each rank's pieces are torch.chunk's dim-0 chunks, and the unsharded views of the
    all-gathered shards give the parameters back (uneven and empty chunks included)."""
    from fullshard._engine.layout import make_dim0_layout

    params = [torch.randn(5, 2), torch.randn(3), torch.randn(1, 4)]
    layout = make_dim0_layout(["a", "b", "c"], [p.shape for p in params], [True] * 3, num_shards)
    shards = []
    for rank in range(num_shards):
        shard = torch.zeros(layout.shard_numel)
        for param, piece in zip(params, layout.shard_pieces(rank)):
            expected = torch.chunk(param, num_shards)
            if piece is None:
                assert rank >= len(expected) or expected[rank].numel() == 0
                continue
            flat = param.reshape(-1)[piece.param_start : piece.param_start + piece.numel]
            torch.testing.assert_close(flat, expected[rank].reshape(-1), rtol=0, atol=0)
            shard[piece.shard_start : piece.shard_start + piece.numel] = flat
        shards.append(shard)
    gathered = torch.cat(shards)
    assert gathered.numel() == layout.padded_numel == layout.leaf_numel
    for param, view in zip(params, layout.unsharded_views(gathered)):
        torch.testing.assert_close(view, param, rtol=0, atol=0)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_dim0_copy_out_and_copy_in_invert_each_other(num_shards: int) -> None:
    """``Dim0Unsharded`` copies each parameter out of the gathered buffer (what the unsharded
    views give), and its autograd node copies gradients back into the buffer's layout, with
    zeros in the padding and for a parameter that got no gradient."""
    from fullshard._engine.dim0_unsharded import Dim0Unsharded
    from fullshard._engine.layout import make_dim0_layout

    shapes = [torch.Size([5, 2]), torch.Size([4]), torch.Size([1, 4])]
    layout = make_dim0_layout(["a", "b", "c"], shapes, [True] * 3, num_shards)
    gathered = torch.randn(layout.padded_numel)
    unsharded = Dim0Unsharded(layout, torch.float32, torch.device("cpu"))
    assert unsharded.nbytes() == 0  # a unit starts sharded: no memory until it unshards
    unsharded.fill(gathered)
    storage = unsharded.tensors[0].untyped_storage()
    assert unsharded.nbytes() == sum(s.numel() for s in shapes) * 4  # one block for all
    assert all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in unsharded.tensors)
    expected = layout.unsharded_views(gathered)
    leaf = torch.zeros(layout.leaf_numel, requires_grad=True)
    views = unsharded.views(leaf)
    for view, value in zip(views, expected):
        torch.testing.assert_close(view, value, rtol=0, atol=0)
    (views[0] * expected[0]).sum().backward(inputs=[leaf], retain_graph=True)
    assert leaf.grad is not None
    into = torch.zeros(layout.padded_numel)
    for param_rows, place in layout.rank_chunks(0, expected[0], into):
        place.copy_(param_rows)
    torch.testing.assert_close(leaf.grad, into, rtol=0, atol=0)  # a's places only
    unsharded.free()
    assert unsharded.nbytes() == 0 and all(v.untyped_storage().nbytes() == 0 for v in views)


def test_dim0_copy_in_of_an_evenly_split_layout_writes_every_place() -> None:
    """With no padding and a gradient for every parameter, the flat gradient is written in
    full (it starts uninitialised): it equals the gathered layout of the gradients."""
    from fullshard._engine.dim0_unsharded import Dim0Unsharded
    from fullshard._engine.layout import make_dim0_layout

    shapes = [torch.Size([4, 3]), torch.Size([0, 5]), torch.Size([2])]
    layout = make_dim0_layout(["a", "empty", "b"], shapes, [True] * 3, 2)
    assert layout.evenly_split
    gathered = torch.randn(layout.padded_numel)
    unsharded = Dim0Unsharded(layout, torch.float32, torch.device("cpu"))
    unsharded.fill(gathered)
    leaf = torch.zeros(layout.leaf_numel, requires_grad=True)
    views = unsharded.views(leaf)
    sum((view * view.detach()).sum() for view in views).backward()  # d/dview = view
    torch.testing.assert_close(leaf.grad, gathered, rtol=0, atol=0)


def test_dim0_layout_refuses_scalars() -> None:
    from fullshard._engine.layout import make_dim0_layout

    with pytest.raises(ValueError, match="parameter s is 0-dimensional"):
        make_dim0_layout(["s"], [torch.Size([])], [True], 2)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
@pytest.mark.parametrize("sharded", [True, False])
def test_piece_views_are_the_slices_on_every_rank(num_shards: int, sharded: bool) -> None:
    """``PieceViews`` (one split over the pieces and the padding between them) gives every
    rank's pieces of parameters of 1, 6, 7 and 0 elements exactly what slicing gives, and
    ``places`` their addresses and shapes without views."""
    from fullshard._engine.piece_views import PieceViews

    shapes = [torch.Size([1]), torch.Size([2, 3]), torch.Size([7]), torch.Size([0, 4])]
    layout = make_layout(["a", "b", "c", "d"], shapes, [True] * 4, num_shards)
    for rank in range(num_shards if sharded else 1):
        views = PieceViews(layout, layout.shard_pieces(rank), sharded)
        numel = layout.shard_numel if sharded else layout.padded_numel
        flat = torch.arange(numel, dtype=torch.float32)
        split, sliced = views.views(flat), views._sliced(flat)
        assert [v.shape for v in split] == [v.shape for v in sliced]
        assert all(torch.equal(a, b) for a, b in zip(split, sliced))
        for view, place in zip(split, views.places(flat)):
            assert place is not None and place[1] == view.shape
            assert view.numel() == 0 or place[0] == view.data_ptr()
        assert views.places(flat.expand(2, numel)[0].as_strided((numel,), (0,))) == [None] * 4


def test_piece_split_keeps_gaps_and_refuses_overlaps() -> None:
    """The split covers gaps (padding) between spans and after them; overlapping spans,
    which no split gives, ask for slicing instead."""
    from fullshard._engine.piece_views import _split

    assert _split([(2, 3), None, (0, 1)], 9) == ([1, 1, 3, 4], [2, None, 0])
    assert _split([(0, 4), (2, 4)], 8) == ([-1], [None, None])
