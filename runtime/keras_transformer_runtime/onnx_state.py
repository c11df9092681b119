"""The state of `search.search_loop` over an export's decoder step (`OnnxDecoder.start`).

Needs numpy only.
"""

from __future__ import annotations

import numpy as np


class OnnxSearchState:
    """`search.search_loop`'s state on `decoder_step.onnx`: the cross caches once per
    sentence, the self caches per row; finished sentences leave (`drops_finished`)."""

    drops_finished = True
    selects = True

    def __init__(self, decoder, source, rows):
        _, mask, cross = decoder.encode(source)
        self.decoder, self.rows = decoder, rows
        self.feeds = decoder.search_feeds(mask, cross)
        self.caches = decoder.empty_self_caches(len(mask) * rows)

    def step(self, last, t, top_k=0):
        # The first step reads BOS alone in every row of a sentence: it runs one
        # row per sentence, and the rows copy its outputs.
        first = t == 0 and self.rows > 1
        if first:
            last, self.caches = last[:: self.rows], [c[:: self.rows] for c in self.caches]
        feeds = dict(self.feeds, token_ids=last[:, None].copy())
        feeds.update(zip(self.decoder.cache_names("self"), self.caches, strict=True))
        if not top_k:
            log_probs, self.caches = self.decoder.run_log_probs(feeds)
            top = None
        else:
            log_probs, top, self.caches = self.decoder.run_log_probs(feeds, top_k)
        if first:
            log_probs = np.repeat(log_probs, self.rows, axis=0)
            self.caches = [np.repeat(c, self.rows, axis=0) for c in self.caches]
            top = None if top is None else tuple(np.repeat(a, self.rows, axis=0) for a in top)
        return log_probs if top is None else (log_probs, top)

    def reorder(self, rows):
        if len(rows) == len(self.caches[0]):
            # The caches are the step's own outputs: only rows that take another
            # row's cache are copied, in place (a beam's best often extends itself).
            moved = np.flatnonzero(rows != np.arange(len(rows)))
            for cache in self.caches:
                cache[moved] = cache[rows[moved]]
        else:
            self.caches = [cache[rows] for cache in self.caches]
        kept = rows[:: self.rows] // self.rows  # each sentence's first row names it
        if len(kept) != len(self.feeds["source_mask"]):
            self.feeds = {name: value[kept] for name, value in self.feeds.items()}
