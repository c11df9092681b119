"""Synthetic training batches shaped like the package's pipeline, and their model FLOPs."""

from __future__ import annotations

import math

import numpy as np


def make_batches(max_length, tokens_per_batch, count, vocabulary_size, seed=0):
    """`count` padded batches of ~`tokens_per_batch` tokens per side.

    Returns a list of dicts with int32 arrays `source`, `target_in`, `labels`
    (padding id 0, BOS 1, EOS 2) and the real lengths `source_lengths`,
    `target_lengths`.
    """
    from keras_transformer.data.pipeline import bucket_boundaries

    rng = np.random.default_rng(seed)
    boundaries = bucket_boundaries(max_length)
    pairs = 20000
    source_len = np.clip(np.round(rng.lognormal(math.log(24), 0.5, pairs)), 3, max_length - 1)
    ratio = rng.lognormal(0.0, 0.15, pairs)
    target_len = np.clip(np.round(source_len * ratio), 3, max_length - 1)
    source_len, target_len = source_len.astype(int) + 1, target_len.astype(int) + 1  # EOS/BOS
    longest = np.maximum(source_len, target_len)
    width_of = np.array([next(b for b in boundaries if b >= n) for n in longest])
    # Pick the buckets of the batches as the pipeline would meet them: a batch's
    # bucket is drawn with probability proportional to the tokens it holds.
    widths, weights = np.unique(width_of, return_counts=True)
    weights = weights * widths
    chosen = rng.choice(widths, size=count, replace=False, p=weights / weights.sum())
    batches = []
    for width in sorted(chosen):
        members = np.flatnonzero(width_of == width)
        size = max(1, tokens_per_batch // width)
        picked = rng.choice(members, size=min(size, len(members)), replace=False)
        if len(picked) < size:  # a rare bucket: reuse pairs to fill the batch
            picked = rng.choice(members, size=size, replace=True)
        src = np.zeros((size, width), np.int32)
        tin = np.zeros((size, width), np.int32)
        lab = np.zeros((size, width), np.int32)
        for row, k in enumerate(picked):
            s, t = source_len[k], target_len[k]
            src[row, : s - 1] = rng.integers(3, vocabulary_size, s - 1)
            src[row, s - 1] = 2
            words = rng.integers(3, vocabulary_size, t - 1)
            tin[row, 0] = 1
            tin[row, 1:t] = words
            lab[row, : t - 1] = words
            lab[row, t - 1] = 2
        batches.append(
            {
                "source": src,
                "target_in": tin,
                "labels": lab,
                "source_lengths": source_len[picked],
                "target_lengths": target_len[picked],
            }
        )
    return batches


def training_flops(config, source_lengths, target_lengths):
    """Model FLOPs of one training step on these real lengths (3 x forward).

    A multiply-add counts 2. Attention scores and values are counted over the
    whole key range (causal or not), as every implementation computes them.
    """
    d, ff, layers, vocab = (
        config.hidden_dim,
        config.intermediate_dim,
        config.num_layers,
        config.vocabulary_size,
    )
    s = np.asarray(source_lengths, np.float64)
    t = np.asarray(target_lengths, np.float64)
    encoder = layers * (
        2 * s.sum() * 4 * d * d  # Q, K, V, output projections
        + 2 * 2 * (s * s).sum() * d  # scores and weighted values
        + 2 * s.sum() * 2 * d * ff  # feed-forward
    )
    decoder = layers * (
        2 * t.sum() * 4 * d * d  # self-attention projections
        + 2 * 2 * (t * t).sum() * d
        + 2 * t.sum() * 2 * d * d  # cross-attention Q and output
        + 2 * s.sum() * 2 * d * d  # cross-attention K and V
        + 2 * 2 * (t * s).sum() * d
        + 2 * t.sum() * 2 * d * ff
    )
    output = 2 * t.sum() * d * vocab
    return 3.0 * (encoder + decoder + output)
