import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_roundpipe.plan import PlanError, transfer_windows


def covered_exactly(tensors, windows):
    spans = {}
    for w in windows:
        for p in w.pieces:
            spans.setdefault(p.name, []).append((p.offset, p.offset + p.nbytes))
    for name, nbytes in tensors:
        pos = 0
        for a, b in sorted(spans.get(name, [])):
            if a != pos:
                return False
            pos = b
        if pos != nbytes:
            return False
    return set(spans) <= {n for n, _ in tensors}


def test_lm_head_is_split_and_spread():
    tensors = [("embed", 400), ("lm_head", 1600), ("norm", 8)]
    windows = transfer_windows(tensors, 4)
    assert covered_exactly(tensors, windows)
    assert [w.nbytes for w in windows] == [502, 502, 502, 502]
    assert sum(1 for w in windows for p in w.pieces if p.name == "lm_head") == 4


def test_explicit_chunk_and_alignment():
    windows = transfer_windows([("a", 1000)], 3, chunk_bytes=300, align=128)
    sizes = sorted(p.nbytes for w in windows for p in w.pieces)
    assert sizes == [232, 384, 384]  # chunk rounded up to 384 = 3 * 128
    assert all(p.offset % 128 == 0 for w in windows for p in w.pieces)


def test_deterministic_ties():
    tensors = [(f"t{i}", 10) for i in range(5)]
    a = transfer_windows(tensors, 2, chunk_bytes=100)
    b = transfer_windows(tensors, 2, chunk_bytes=100)
    assert [[p.name for p in w.pieces] for w in a] == [["t0", "t2", "t4"], ["t1", "t3"]]
    assert [[p.name for p in w.pieces] for w in a] == [[p.name for p in w.pieces] for w in b]


def test_empty_and_zero_sized():
    windows = transfer_windows([("z", 0)], 3)
    assert [w.nbytes for w in windows] == [0, 0, 0]
    assert transfer_windows([], 2)[1].pieces == []


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (([("a", 1)], 0), {}, "num_windows must be an integer >= 1, got 0"),
        (([("a", 1), ("a", 2)], 2), {}, "tensor name 'a' appears twice"),
        (([("a", -1)], 2), {}, "tensor 'a' has size -1"),
        (([("a", 5)], 2), {"chunk_bytes": 0}, "chunk_bytes must be >= 1"),
        (([("a", 5)], 2), {"align": 0}, "align must be >= 1"),
    ],
)
def test_errors(args, kwargs, match):
    with pytest.raises(PlanError, match=match):
        transfer_windows(*args, **kwargs)


sizes = st.lists(st.integers(0, 10_000), min_size=0, max_size=12)


@settings(max_examples=200, deadline=None)
@given(sizes, st.integers(1, 8), st.one_of(st.none(), st.integers(1, 5000)))
def test_list_scheduling_bound(sz, m, chunk):
    tensors = [(f"t{i}", s) for i, s in enumerate(sz)]
    windows = transfer_windows(tensors, m, chunk_bytes=chunk)
    assert len(windows) == m
    assert covered_exactly(tensors, windows)
    pieces = [p.nbytes for w in windows for p in w.pieces]
    total = sum(pieces)
    assert total == sum(sz)
    limit = chunk if chunk is not None else max(1, math.ceil(total / m))
    assert all(p <= limit for p in pieces)
    largest = max(pieces, default=0)
    # any list schedule: heaviest <= average + (1 - 1/m) * largest piece
    assert max(w.nbytes for w in windows) <= total / m + (1 - 1 / m) * largest + 1e-9


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=7), st.integers(2, 3))
def test_lpt_is_within_graham_bound_of_optimum(sz, m):
    tensors = [(f"t{i}", s) for i, s in enumerate(sz)]
    windows = transfer_windows(tensors, m, chunk_bytes=10**9)  # no splitting
    lpt = max(w.nbytes for w in windows)
    opt = min(
        max(sum(s for s, w in zip(sz, assign) if w == k) for k in range(m))
        for assign in itertools.product(range(m), repeat=len(sz))
    )
    assert lpt <= (4 / 3 - 1 / (3 * m)) * opt + 1e-9
