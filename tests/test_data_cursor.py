"""Unit and property tests of the pure data cursor."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictrain.data.cursor import (
    CursorError,
    CursorState,
    check_layout,
    epoch_permutation,
    micro_batch_positions,
    rank_micro_batches,
    sample_ids,
    step_sample_ids,
    valid_world_sizes,
)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, int, int]:
    """A valid (global_batch, micro_batch, world_size): G = W * m * accum."""
    micro = draw(st.integers(1, 8))
    world = draw(st.integers(1, 8))
    accum = draw(st.integers(1, 4))
    return world * micro * accum, micro, world


def _all_rank_ids(step: int, g: int, m: int, w: int, seed: int, n: int) -> list[int]:
    ids: list[int] = []
    for rank in range(w):
        for batch in rank_micro_batches(step, rank, w, m, g, seed, n):
            assert len(batch) == m
            ids.extend(batch.tolist())
    return ids


@settings(max_examples=60, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**32), n=st.integers(1, 300), step=st.integers(0, 20))
def test_ranks_partition_the_step(layout: tuple[int, int, int], seed: int, n: int, step: int) -> None:
    g, m, w = layout
    positions = sorted(
        p
        for rank in range(w)
        for k in range(check_layout(g, m, w))
        for p in micro_batch_positions(step, rank, w, m, g, k)
    )
    assert positions == list(range(step * g, (step + 1) * g))
    ids = _all_rank_ids(step, g, m, w, seed, n)
    assert sorted(ids) == sorted(step_sample_ids(step, g, seed, n).tolist())


@settings(max_examples=40, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**32), n=st.integers(1, 200))
def test_epoch_zero_seen_exactly_once(layout: tuple[int, int, int], seed: int, n: int) -> None:
    g, m, w = layout
    accum = check_layout(g, m, w)
    by_position: dict[int, int] = {}
    for step in range(math.ceil(n / g)):
        for rank in range(w):
            batches = rank_micro_batches(step, rank, w, m, g, seed, n)
            for k, batch in enumerate(batches):
                positions = micro_batch_positions(step, rank, w, m, g, k)
                for position, sample in zip(positions, batch.tolist(), strict=True):
                    assert position not in by_position
                    by_position[position] = sample
        assert len(batches) == accum
    epoch0 = [by_position[p] for p in range(n)]
    assert sorted(epoch0) == list(range(n))
    # Positions past n belong to later epochs, each in its own permutation's order.
    spill = [by_position[p] for p in range(n, len(by_position))]
    later = [epoch_permutation(seed, e, n).tolist() for e in range(1, 2 + len(spill) // n)]
    assert spill == sum(later, [])[: len(spill)]


@settings(max_examples=40, deadline=None)
@given(
    micro=st.integers(1, 4),
    accum=st.integers(1, 3),
    worlds=st.lists(st.integers(1, 6), min_size=2, max_size=3),
    seed=st.integers(0, 1000),
    n=st.integers(1, 150),
    step=st.integers(0, 10),
)
def test_step_ids_do_not_depend_on_world_size(
    micro: int, accum: int, worlds: list[int], seed: int, n: int, step: int
) -> None:
    g = math.lcm(*worlds) * micro * accum
    reference = sorted(step_sample_ids(step, g, seed, n).tolist())
    for w in worlds:
        assert sorted(_all_rank_ids(step, g, micro, w, seed, n)) == reference


@settings(max_examples=60, deadline=None)
@given(g=st.integers(1, 96), m=st.integers(1, 8), w=st.integers(1, 16))
def test_invalid_layouts_raise_with_valid_sizes(g: int, m: int, w: int) -> None:
    if g % (w * m) == 0:
        assert check_layout(g, m, w) == g // (w * m)
        return
    with pytest.raises(CursorError) as info:
        check_layout(g, m, w)
    message = str(info.value)
    assert f"global_batch={g}" in message and f"world_size={w}" in message
    assert "global_batch % (world_size * micro_batch) == 0" in message
    assert str(valid_world_sizes(g, m, 64)) in message
    assert "Fix:" in message


def test_valid_world_sizes() -> None:
    assert valid_world_sizes(32, 4, 64) == [1, 2, 4, 8]
    assert valid_world_sizes(12, 1, 5) == [1, 2, 3, 4]
    assert valid_world_sizes(6, 4, 64) == []
    with pytest.raises(CursorError):
        valid_world_sizes(0, 1, 4)


def test_permutation_is_pure_and_read_only() -> None:
    a = epoch_permutation(7, 3, 100)
    b = epoch_permutation(7, 3, 100)
    assert a.dtype == np.int64
    assert sorted(a.tolist()) == list(range(100))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, epoch_permutation(7, 4, 100))
    assert not np.array_equal(a, epoch_permutation(8, 3, 100))
    with pytest.raises(ValueError):
        a[0] = 5


def test_sample_ids_cross_epoch_boundary() -> None:
    n = 10
    ids = sample_ids(7, 16, seed=3, n=n)
    expected = np.concatenate(
        [epoch_permutation(3, 0, n)[7:], epoch_permutation(3, 1, n), epoch_permutation(3, 2, n)[:3]]
    )
    assert np.array_equal(ids, expected)
    assert len(sample_ids(5, 0, 3, n)) == 0


def test_micro_batch_positions_formula_and_bounds() -> None:
    # G=24, m=2, W=3 -> accum=4; rank 1, micro-batch 2 of step 5: 5*24 + (2*3+1)*2 = 134.
    assert micro_batch_positions(5, 1, 3, 2, 24, 2) == range(134, 136)
    with pytest.raises(CursorError, match="rank=3"):
        micro_batch_positions(0, 3, 3, 2, 24, 0)
    with pytest.raises(CursorError, match="k=4"):
        micro_batch_positions(0, 0, 3, 2, 24, 4)
    with pytest.raises(CursorError, match="world_size=5"):
        micro_batch_positions(0, 0, 5, 2, 24, 0)


def test_rank_micro_batches_in_order() -> None:
    batches = rank_micro_batches(2, 1, 2, 2, 8, seed=0, n=50)
    assert len(batches) == 2
    all_ids = step_sample_ids(2, 8, 0, 50)
    # rank 1 takes positions (k*W + r)*m: offsets 2..4 then 6..8 within the step.
    assert np.array_equal(batches[0], all_ids[2:4])
    assert np.array_equal(batches[1], all_ids[6:8])


def test_cursor_state_round_trip_and_properties() -> None:
    state = CursorState(step=7, global_batch=32, seed=1, dataset_len=100)
    assert state.position == 224
    assert state.epoch == 2
    assert CursorState.from_dict(state.to_dict()) == state
    with pytest.raises(CursorError, match="missing keys \\['seed'\\]"):
        CursorState.from_dict({"step": 1, "global_batch": 2, "dataset_len": 3})
    with pytest.raises(CursorError, match="unknown keys \\['extra'\\]"):
        CursorState.from_dict({**state.to_dict(), "extra": 1})
    with pytest.raises(CursorError):
        CursorState(step=-1, global_batch=32, seed=1, dataset_len=100)


def test_cursor_state_compatibility() -> None:
    state = CursorState(step=7, global_batch=32, seed=1, dataset_len=100)
    state.check_compatible(CursorState(step=99, global_batch=32, seed=1, dataset_len=100))
    for field, value in (("global_batch", 64), ("seed", 2), ("dataset_len", 101)):
        other = CursorState(**{**state.to_dict(), field: value})
        with pytest.raises(CursorError, match=field):
            state.check_compatible(other)
