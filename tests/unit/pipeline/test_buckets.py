"""Static batch buckets: which batch sizes a worker compiles, and how a group splits into them."""

from __future__ import annotations

import pytest

from pipeline.buckets import bucket_sizes, split, split_counts


@pytest.mark.parametrize(("batch", "buckets"), [(1, (1,)), (2, (1, 2)), (6, (1, 2, 4)), (8, (1, 2, 4, 8)),
                                                 (16, (1, 2, 4, 8, 16)), (17, (1, 2, 4, 8, 16))])
def test_buckets_are_powers_of_two_up_to_the_batch_size(batch, buckets):
    assert bucket_sizes(batch) == buckets


def test_a_batch_size_below_one_is_refused():
    with pytest.raises(ValueError, match=">= 1"):
        bucket_sizes(0)


@pytest.mark.parametrize(("n", "counts"), [(7, [4, 2, 1]), (4, [4]), (11, [4, 4, 2, 1]), (1, [1]), (0, [])])
def test_groups_split_largest_first(n, counts):
    assert split_counts(n, (1, 2, 4)) == counts


def test_split_keeps_order_and_every_item():
    items = list("abcdefg")
    chunks = split(items, (1, 2, 4))
    assert chunks == [list("abcd"), list("ef"), list("g")]


def test_buckets_without_one_are_refused():
    with pytest.raises(ValueError, match="include 1"):
        split_counts(3, (2, 4))
