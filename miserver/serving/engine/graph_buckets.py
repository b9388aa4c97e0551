"""The buckets of the decode engine (:mod:`miserver.serving.engine.decode_graphs`): the cache
lengths that get a graph of their own, the batch sizes (rows) that get batched graphs, and the
smallest bucket that holds a number of positions."""

from __future__ import annotations

from collections.abc import Sequence

#: The smallest bucket, in positions (tokens of prompt plus completion).
SMALLEST_BUCKET = 256


def bucket_lengths(context: int, smallest: int = SMALLEST_BUCKET) -> tuple[int, ...]:
    """The cache lengths that get a graph: powers of two from ``smallest`` below ``context``,
    then ``context`` itself (positions; ``context`` >= 1).

    >>> bucket_lengths(8192)
    (256, 512, 1024, 2048, 4096, 8192)
    >>> bucket_lengths(3000)
    (256, 512, 1024, 2048, 3000)
    >>> bucket_lengths(100)
    (100,)
    """
    if context < 1:
        raise ValueError(f"context must be at least 1 position, got {context}")
    out: list[int] = []
    length = smallest
    while length < context:
        out.append(length)
        length *= 2
    out.append(context)
    return tuple(out)


def row_buckets(rows: int) -> tuple[int, ...]:
    """The batch sizes that get graphs of their own: powers of two from 2 below ``rows``, then
    ``rows`` itself (none below 2: one sequence decodes through the one-sequence graphs).

    >>> row_buckets(32)
    (2, 4, 8, 16, 32)
    >>> row_buckets(24)
    (2, 4, 8, 16, 24)
    >>> row_buckets(1)
    ()
    """
    out: list[int] = []
    size = 2
    while size < rows:
        out.append(size)
        size *= 2
    if rows >= 2:
        out.append(rows)
    return tuple(out)


def pick_bucket(buckets: Sequence[int], positions: int) -> int:
    """The smallest bucket that holds ``positions`` (the cache entries attention must see).

    Raises:
        ValueError: ``positions`` exceeds the largest bucket (the context).
    """
    for length in buckets:
        if positions <= length:
            return length
    raise ValueError(f"{positions} positions do not fit the context of {buckets[-1]}")
