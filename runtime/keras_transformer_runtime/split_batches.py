"""How a batch searched as several parts at once is cut: parts of like length.

Needs numpy only.
"""

from __future__ import annotations

import numpy as np

# A part's time is estimated as (rows + this) x its longest source: the
# rows' work plus the fixed cost of every step's operators, in rows.
SPLIT_STEP_ROWS = 8


def length_runs(lengths, parts, step_rows=SPLIT_STEP_ROWS):
    """Indices of `lengths` cut into `parts` runs in order of length (shortest first), each
    non-empty, that make the longest estimated part time, `(rows + step_rows) x longest
    length`, as short as it can be.

    Against dealing the sentences out in turn (every part then runs as long as
    the longest sentence of the whole batch), a part of short sentences takes
    more of them and ends with the part of long ones: the padding of a batch
    of mixed lengths is not computed.
    """
    lengths = np.asarray(lengths)
    order = np.argsort(lengths, kind="stable")
    ordered = np.maximum(lengths[order], 1).astype(np.float64)
    count = len(order)
    parts = max(1, min(parts, count))

    def cuts_within(limit):
        """Ends of the runs, made greedily from the shortest, none over `limit`; or None."""
        ends, start = [], 0
        while start < count:
            end = start + 1
            if (1 + step_rows) * ordered[start] > limit:
                return None
            while end < count and (end + 1 - start + step_rows) * ordered[end] <= limit:
                end += 1
            ends.append(end)
            start = end
        return ends if len(ends) <= parts else None

    low, high = 0.0, (count + step_rows) * ordered[-1]
    for _ in range(50):  # bisection on the longest part time
        middle = (low + high) / 2
        if cuts_within(middle) is None:
            low = middle
        else:
            high = middle
    ends = cuts_within(high)
    # Fewer runs than parts: split the largest runs so that every part has work.
    runs = [order[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    while len(runs) < parts:
        largest = max(range(len(runs)), key=lambda i: len(runs[i]))
        run = runs.pop(largest)
        runs[largest:largest] = [run[: len(run) // 2], run[len(run) // 2 :]]
    return runs
