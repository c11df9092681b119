"""The automatic batch size of a run (`train --tokens-per-batch` left out)."""

from __future__ import annotations

# The automatic batch size (`tokens_per_batch=None`): the largest of these that
# still gives an epoch MIN_UPDATES_PER_EPOCH optimizer updates. On Multi30k,
# 4096-token batches (134 updates an epoch) were far behind 2048-token ones
# (258) at every epoch of a 10-epoch budget, and 1024-token ones (507) ahead of
# 2048 in both directions (benchmarks/results/multi30k/); a large corpus keeps
# 4096.
AUTO_TOKENS_PER_BATCH = (4096, 2048, 1024)

MIN_UPDATES_PER_EPOCH = 400


def automatic_tokens_per_batch(pairs, accumulate_steps=1):
    """The largest of `AUTO_TOKENS_PER_BATCH` whose epoch over `pairs` (`EncodedPairs`)
    has at least `MIN_UPDATES_PER_EPOCH` optimizer updates, else the smallest."""
    for tokens_per_batch in AUTO_TOKENS_PER_BATCH:
        if pairs.batches(tokens_per_batch) // accumulate_steps >= MIN_UPDATES_PER_EPOCH:
            return tokens_per_batch
    return AUTO_TOKENS_PER_BATCH[-1]


def automatic_batch_rule() -> str:
    """`automatic_tokens_per_batch`'s rule in words, for the help and the run's log.

    >>> automatic_batch_rule()
    'the largest of 4096, 2048, 1024 that gives at least 400 updates an epoch, or the smallest'
    """
    return (
        f"the largest of {', '.join(map(str, AUTO_TOKENS_PER_BATCH))} that gives at least "
        f"{MIN_UPDATES_PER_EPOCH} updates an epoch, or the smallest"
    )
