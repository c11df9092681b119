"""Continuous batching: sentences join a running search between its steps and leave when they end.

`SearchStream` is the one search loop (`search.SearchLoop`, the rules of
`spec.SentenceSearch`) over a state whose rows may start at different steps
(`onnx_state.StaggeredState`, on an export's `decoder_step_staggered.onnx`).
The server's continuous batching runs it: a finished sentence is answered at
once and its rows go to the next waiting sentence, instead of every
sentence of a batch waiting for its longest. A sentence's hypotheses are
those `Translator.search` gives it alone (the float32 graphs give the same
tokens; int8 graphs quantize each step's activations over the rows the step
holds, so their scores depend on the batch, as they do in any batch).

Needs numpy only.
"""

from __future__ import annotations

import numpy as np

from keras_transformer_runtime.search import SearchLoop, add_alignments, sentence_searches
from keras_transformer_runtime.sources import output_limits, prefixed_limits
from keras_transformer_runtime.spec import truncate_source


class SearchStream:
    """A search that sentences join between steps (`admit`) and leave as they end (`step`).

    Args:
        translator: a `translator.Translator` whose decoder `staggers`
            (`OnnxDecoder.start_staggered`).
        options: the `SearchOptions` every sentence of the stream is searched under.
    """

    def __init__(self, translator, options):
        decoder = translator.decoder
        if not getattr(decoder, "staggers", False):
            raise ValueError(
                "this decoder has no staggered step (decoder_step_staggered.onnx): "
                "export the model again to batch continuously."
            )
        self.translator, self.options = translator, options
        self.state = decoder.start_staggered(options.beam_size)
        self.loop = SearchLoop(
            self.state.step,
            self.state.reorder,
            options,
            [],
            drop_finished=True,
            selects=getattr(self.state, "selects", False),
        )
        self._held = {}  # id(search) -> (handle, source ids)

    @property
    def live(self):
        """The sentences being searched."""
        return len(self._held)

    @property
    def longest_source(self):
        """The longest source being searched, in tokens (0 for none)."""
        return max((len(source) for _, source in self._held.values()), default=0)

    def admit(self, handles, sources, prefixes=None, indices=None, constraints=None):
        """Adds sentences to the search: `sources` as token-id lists (EOS last), with
        their `handles` (anything, returned with their results), target
        `prefixes`, `indices` (their index in their input, which seeds sampling)
        and `constraints` as for `Translator.search`.

        Returns `[(handle, hypotheses)]` for the sentences that need no step
        (an empty source); the others come out of `step`.
        """
        options, translator = self.options, self.translator
        count = len(sources)
        sources = [[int(t) for t in row] for row in sources]
        if options.max_input_length is not None:
            sources = [truncate_source(row, options.max_input_length) for row in sources]
        prefixes = prefixes if prefixes is not None else [()] * count
        indices = indices if indices is not None else range(count)
        constraints = constraints if constraints is not None else [()] * count
        for name, given in (("prefixes", prefixes), ("indices", indices)):
            if len(given) != count:
                raise ValueError(f"{len(given)} {name} for {count} sources: give one each.")
        if len(constraints) != count:
            raise ValueError(f"{len(constraints)} constraint lists for {count} sources.")
        options.check_ids(translator.vocabulary_size, prefixes)
        lengths = np.array([len(row) for row in sources], np.int64)
        limits = output_limits(lengths, options.max_length, translator.max_length)
        limits = prefixed_limits(limits, prefixes, options.max_length)
        searches = sentence_searches(limits, options, prefixes, indices, constraints)
        ready, joining = [], []
        for handle, source, search in zip(handles, sources, searches, strict=True):
            if search.done:
                ready.append((handle, search.results()))
            else:
                joining.append(search)
                self._held[id(search)] = (handle, source)
        if joining:
            joined = [self._held[id(search)][1] for search in joining]
            self.loop.admit(joining, lambda positions: self.state.admit(joined, positions))
        return ready

    def step(self):
        """One decoder step of every sentence held; returns `[(handle, hypotheses)]` for
        those that ended (with their `alignment` where `options.alignment` asks)."""
        ended = self.loop.step()
        if not ended:
            return []
        self.state.release([position for position, _ in ended])
        held = [self._held.pop(id(search)) for _, search in ended]
        found = [search.results() for _, search in ended]
        if self.options.alignment:
            add_alignments(found, [source for _, source in held], self.translator.align_ids)
        return [(handle, hypotheses) for (handle, _), hypotheses in zip(held, found, strict=True)]
