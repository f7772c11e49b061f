"""Nested values on torch's pytree, mappings pytree does not know included."""

import collections

import pytest
import torch
from transformers import BatchEncoding

from lightning_roundpipe.runtime.nested import (
    batch_size_of,
    flatten_tensors,
    map_tensors,
    merge_microbatches,
    split_microbatches,
)

Pair = collections.namedtuple("Pair", "ids extra")


def value():
    return {
        "ids": torch.arange(10).reshape(5, 2),
        "pair": Pair(torch.ones(5, 3), 7),
        "enc": BatchEncoding(
            {"mask": torch.zeros(5, 2), "inner": collections.UserDict(w=torch.ones(2))}
        ),
        "scalar": torch.tensor(3.0),
    }


def test_tensors_inside_foreign_mappings_are_mapped_and_flattened():
    v = value()
    shapes = [tuple(t.shape) for t in flatten_tensors(v)]
    assert shapes == [(5, 2), (5, 3), (5, 2), (2,), ()]
    doubled = map_tensors(lambda t: t * 2, v)
    assert doubled["pair"].extra == 7 and isinstance(doubled["pair"], Pair)
    torch.testing.assert_close(doubled["enc"]["inner"]["w"], torch.full((2,), 2.0))
    assert batch_size_of(v) == 5


def test_split_then_merge_gives_the_batch_back():
    v = value()
    parts = split_microbatches(v, 2, 5)
    assert [batch_size_of(p) for p in parts] == [3, 2]
    # tensors without the batch dimension go to every micro-batch
    assert all(p["enc"]["inner"]["w"] is v["enc"]["inner"]["w"] for p in parts)
    merged = merge_microbatches(parts)
    torch.testing.assert_close(merged["ids"], v["ids"])
    torch.testing.assert_close(merged["enc"]["mask"], v["enc"]["mask"])
    assert merged["pair"].extra == 7
    assert merged["scalar"] is v["scalar"]  # given to every micro-batch: one value


def test_one_value_per_micro_batch_cannot_be_merged_into_the_batchs():
    """Differing 0-d outputs (a layer that reduces its micro-batch) from several
    micro-batches are refused, saying what to do; from one it comes back as it
    is (a scalar, as the unsplit model returns it)."""
    with pytest.raises(
        ValueError, match=r"0-dim tensor .* from 2 micro-batches .*num_microbatches=1"
    ):
        merge_microbatches([torch.tensor(1.0), torch.tensor(2.0)])
    one = torch.tensor(3.0)
    assert merge_microbatches([one]) is one
