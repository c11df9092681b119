"""The states of `search.SearchLoop` over an export's decoder step: `OnnxSearchState`
for a batch searched from start to end (`OnnxDecoder.start`), `StaggeredState` for
one that sentences join between steps (`OnnxDecoder.start_staggered`).

Needs numpy only.
"""

from __future__ import annotations

import numpy as np

from keras_transformer_runtime.sources import source_array


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


# A staggered state cuts the cache slots no live row reads once they are at
# least this many and a quarter of the cache: each cut copies every cache,
# as the step's own growth of the caches does.
TRIM_SLOTS = 8


class StaggeredState(OnnxSearchState):
    """`search.SearchLoop`'s state on `decoder_step_staggered.onnx`: sentences join
    between steps (`admit`) and leave (`reorder` with fewer rows, `release`).

    Every row holds the same cache length; a row that joined later starts at
    a later slot (`first_slots`), and the step masks the slots before it. The
    cross caches hold one row per sentence, padded to the longest source
    held (`source_mask` covers the padding). Slots that no live row reads
    any more are cut from the front (`TRIM_SLOTS`), and the sources' width
    shrinks once the longest sentences have left.
    """

    def __init__(self, decoder, rows):
        self.decoder, self.rows = decoder, rows
        self.feeds, self.caches = None, decoder.empty_self_caches(0)
        self.first_slots = np.zeros(0, np.int64)
        self.held = np.zeros(0, bool)  # per row: a sentence being searched
        self.source_lengths = np.zeros(0, np.int64)  # per sentence position

    def admit(self, sources, positions):
        """Encodes `sources` (token-id lists) into sentence positions `positions`: those
        below the state's sentence count replace a released sentence, the others
        (consecutive from that count) are added."""
        source, lengths = source_array(sources, self.decoder.max_length, 1)
        _, mask, cross = self.decoder.encode(source)
        new = self.decoder.search_feeds(mask, cross)
        held = len(self.source_lengths)
        width = max(mask.shape[1], self.feeds["source_mask"].shape[1] if held else 0)
        new = {name: _widen(value, width) for name, value in new.items()}
        if held:
            self.feeds = {name: _widen(value, width) for name, value in self.feeds.items()}
        positions = np.asarray(positions)
        added = positions >= held
        if added.any():
            grow = int(added.sum())
            # Fancy indexing copies: the encoder's outputs are kept by `encode`.
            self.feeds = {
                name: np.concatenate([self.feeds[name], value[added]]) if held else value[added]
                for name, value in new.items()
            }
            shape = (grow * self.rows, *self.caches[0].shape[1:])
            self.caches = [np.concatenate([c, np.zeros(shape, c.dtype)]) for c in self.caches]
            self.first_slots = np.concatenate(
                [self.first_slots, np.zeros(grow * self.rows, np.int64)]
            )
            self.held = np.concatenate([self.held, np.zeros(grow * self.rows, bool)])
            self.source_lengths = np.concatenate([self.source_lengths, np.zeros(grow, np.int64)])
        if not added.all():
            for name, value in self.feeds.items():
                value[positions[~added]] = new[name][~added]
        self.source_lengths[positions] = lengths
        rows = (positions[:, None] * self.rows + np.arange(self.rows)).reshape(-1)
        self.first_slots[rows] = self.caches[0].shape[2]  # their first token's slot
        self.held[rows] = True

    def release(self, positions):
        """The sentences at `positions` ended: their rows are no longer read."""
        rows = (np.asarray(positions)[:, None] * self.rows + np.arange(self.rows)).reshape(-1)
        self.held[rows] = False

    def step(self, last, t, top_k=0):
        feeds = dict(self.feeds, token_ids=last[:, None].copy(), first_slots=self.first_slots)
        feeds.update(zip(self.decoder.cache_names("self"), self.caches, strict=True))
        found = self.decoder.run_log_probs(feeds, top_k, graph="decoder_step_staggered")
        self.caches = found[-1]
        return found[0] if not top_k else found[:2]

    def reorder(self, rows):
        super().reorder(rows)
        kept = rows[:: self.rows] // self.rows
        if len(rows) != len(self.first_slots):
            self.source_lengths = self.source_lengths[kept]
        self.first_slots, self.held = self.first_slots[rows], self.held[rows]
        self._trim()

    def _trim(self):
        """Cuts the cache slots before every held row's first, and the source columns
        past the longest held source, once they are worth a copy."""
        if not self.held.any():
            return
        length = self.caches[0].shape[2]
        cut = int(self.first_slots[self.held].min())
        if cut >= TRIM_SLOTS and 4 * cut >= length:
            self.caches = [np.ascontiguousarray(c[:, :, cut:]) for c in self.caches]
            self.first_slots = np.maximum(self.first_slots - cut, 0)
        width = self.feeds["source_mask"].shape[1]
        held = self.held[:: self.rows]
        longest = int(self.source_lengths[held].max())
        if width - longest >= TRIM_SLOTS and 4 * (width - longest) >= width:
            self.feeds = {
                name: np.ascontiguousarray(
                    value[:, :longest] if value.ndim == 2 else value[:, :, :longest]
                )
                for name, value in self.feeds.items()
            }


def _widen(value, width):
    """A source mask `(sentences, length)` or cross cache `(sentences, heads, length,
    head_dim)` padded to `width` source positions (masked, zeros)."""
    axis = 1 if value.ndim == 2 else 2
    missing = width - value.shape[axis]
    if missing <= 0:
        return value
    shape = list(value.shape)
    shape[axis] = width
    wide = np.zeros(shape, value.dtype)
    wide[(slice(None),) * axis + (slice(0, value.shape[axis]),)] = value
    return wide
