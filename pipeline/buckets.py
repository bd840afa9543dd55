"""Static batch buckets: the batch sizes a compiled pipeline runs at, and how a group splits into them.

Place in the data flow: worker → :meth:`pipeline.render.Renderer.render` (one group of compatible
requests) → :func:`split` (here) → one pipeline call per bucket. With ``torch.compile(dynamic=False)``
each (batch size × image size) is its own graph, so the farm compiles a few batch sizes, powers of
two up to the worker's batch size, at warm-up (:func:`pipeline.warm.warm_up`), and splits every
group into them, largest first: 7 images → 4 + 2 + 1. No padding: every image is rendered as one of
a real batch of its bucket's size, and nothing rendered is thrown away.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def bucket_sizes(batch_size: int) -> tuple[int, ...]:
    """The powers of two 1, 2, 4, … up to ``batch_size`` (images), ascending.

    Raises:
        ValueError: ``batch_size`` < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    out, n = [], 1
    while n <= batch_size:
        out.append(n)
        n *= 2
    return tuple(out)


def split_counts(n: int, buckets: Sequence[int]) -> list[int]:
    """``n`` images as bucket sizes, largest first (greedy; with powers of two it is the binary
    expansion of ``n``, repeated at the largest bucket): 7 over (1, 2, 4) → [4, 2, 1]; 11 → [4, 4, 2, 1].

    Raises:
        ValueError: ``buckets`` lacks 1 (some ``n`` could not be split) or holds a size < 1.
    """
    sizes = sorted(set(buckets), reverse=True)
    if not sizes or sizes[-1] != 1:
        raise ValueError(f"buckets must include 1, got {tuple(buckets)}")
    counts = []
    for size in sizes:
        while n >= size:
            counts.append(size)
            n -= size
    return counts


def split(items: Sequence[T], buckets: Sequence[int]) -> list[list[T]]:
    """``items`` cut into consecutive chunks of :func:`split_counts` sizes, in order."""
    chunks, start = [], 0
    for count in split_counts(len(items), buckets):
        chunks.append(list(items[start:start + count]))
        start += count
    return chunks
