"""How a step's batch becomes micro-batches, and a micro-batch becomes rows per device.

The runtime splits a batch into micro-batches with :func:`split_sizes` and every micro-batch into
contiguous row ranges among the devices of a stage with :func:`split_rows`; the cost model
predicts with the same integer row counts. Rows are whole samples: a micro-batch of 3 rows
shared 0.49 / 0.51 by two devices gives them 1 and 2 rows, every micro-batch, so the second
device does twice the work of the first (a stage time the continuous shares would put 33%
lower). Keeping one definition here means the prediction and the run cannot drift apart.

Pure: standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["split_rows", "split_sizes"]


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
    so every rank computes the same split.
    """
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    if not shares or any(s < 0 for s in shares) or sum(shares) <= 0:
        raise ValueError(f"shares must be non-negative with a positive sum, got {list(shares)}")
    total = float(sum(shares))
    exact = [num_rows * s / total for s in shares]
    counts = [int(x) for x in exact]
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: num_rows - sum(counts)]:
        counts[i] += 1
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges
