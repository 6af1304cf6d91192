"""How a step's batch becomes micro-batches, and a micro-batch becomes rows per device.

The runtime splits a batch into micro-batches with :func:`split_sizes` and the micro-batches of
a step into contiguous row ranges among the devices of a stage with :func:`split_step_rows`.
Rows are whole samples, so one micro-batch cannot follow the shares exactly: 3 rows shared
0.49 / 0.51 are 1 and 2 rows. Rounding every micro-batch the same way (:func:`split_rows`) would
give the second device twice the first's work in *every* micro-batch, a stage 33% slower than
its shares. :func:`split_step_rows` rounds each micro-batch towards the shares of the whole step
instead (error diffusion): the devices alternate 1-2 and 2-1, and over the step each holds its
share to within one row, which is what the cost model assumes (``share x micro-batch size`` rows
per micro-batch on average).

Pure: standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["split_rows", "split_sizes", "split_step_rows"]


def split_sizes(batch_size: int, num_microbatches: int) -> list[int]:
    """Sizes of ``num_microbatches`` pieces of a batch, as even as possible (larger first)."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if batch_size < num_microbatches:
        raise ValueError(
            f"A batch of {batch_size} samples cannot be split into {num_microbatches} "
            "micro-batches; lower num_microbatches or raise the batch size."
        )
    base, extra = divmod(batch_size, num_microbatches)
    return [base + (1 if i < extra else 0) for i in range(num_microbatches)]


def split_rows(num_rows: int, shares: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous row ranges ``[start, end)`` for ``shares`` of ``num_rows`` rows.

    Largest-remainder rounding: the counts sum to ``num_rows`` and depend only on the inputs,
    so every rank computes the same split. This is :func:`split_step_rows` of one micro-batch.
    """
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    return split_step_rows([num_rows], shares)[0]


def split_step_rows(sizes: Sequence[int], shares: Sequence[float]) -> list[list[tuple[int, int]]]:
    """Contiguous row ranges of every device in each micro-batch of a step (sizes ``sizes``).

    Each micro-batch gives every device the floor of its exact share of the rows; the rows left
    over go to the devices furthest behind their share of the step so far (ties: lower index).
    One micro-batch is exactly :func:`split_rows`. Over the step every device's row count is
    within one row of ``share x sum(sizes)``; the result depends only on the inputs, so every
    rank computes the same split.
    """
    if not shares or any(s < 0 for s in shares) or sum(shares) <= 0:
        raise ValueError(f"shares must be non-negative with a positive sum, got {list(shares)}")
    total = float(sum(shares))
    given = [0] * len(shares)
    done = 0
    out = []
    for size in sizes:
        if size < 0:
            raise ValueError(f"micro-batch sizes must be >= 0, got {list(sizes)}")
        done += size
        counts = [int(size * s / total) for s in shares]
        behind = [done * s / total - given[i] - counts[i] for i, s in enumerate(shares)]
        order = sorted(range(len(shares)), key=lambda i: (-behind[i], i))
        for i in order[: size - sum(counts)]:
            counts[i] += 1
        ranges, start = [], 0
        for i, c in enumerate(counts):
            ranges.append((start, start + c))
            start += c
            given[i] += c
        out.append(ranges)
    return out
