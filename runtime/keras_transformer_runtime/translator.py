"""One translation core over any decoder: search, scoring, alignment and texts, written once.

`Translator(decoder, tokenizer)` serves the ONNX Runtime decoder
(`OnnxTranslator`, `onnx_decoder.OnnxDecoder`) and the Keras one
(`keras_transformer.keras_decoder.KerasDecoder`) alike: every option takes
the same path whatever runs the model. Plain options (beam size, length
penalty, lengths) run the decoder's graph-resident search where it has one;
anything else runs `search.search_loop` over its cached step.

Needs numpy only.

Example:

    translator = OnnxTranslator("runs/demo-onnx")
    translator.translate(["ko mina tel"], beam_size=4)
"""

from __future__ import annotations

import dataclasses
import queue

import numpy as np

from keras_transformer_runtime.constraints import sentence_constraints, word_continuations
from keras_transformer_runtime.documents import (
    parse_document,
    rebuild_documents,
    sentence_places,
    sentence_terms,
)
from keras_transformer_runtime.export_format import ExportFileError
from keras_transformer_runtime.options import NO_MASKS, SearchOptions
from keras_transformer_runtime.search import (
    add_alignments,
    hypothesis_records,
    plain_hypotheses,
    search_loop,
)
from keras_transformer_runtime.sources import (
    check_beam_arguments,
    check_positive_int,
    output_limits,
    prefixed_limits,
    source_array,
    source_rows,
    teacher_inputs,
    teacher_labels,
)
from keras_transformer_runtime.spec import (
    alignments,
    truncate_source,
)
from keras_transformer_runtime.specials import EOS_ID
from keras_transformer_runtime.tag_placement import sentence_links
from keras_transformer_runtime.text_batches import encode_prefixes, search_texts


def _id_lists(source_ids):
    """Sources as lists of ids without padding (from an int array or lists)."""
    return [row.tolist() for row in source_rows(source_ids)]


def _asked(attention):
    """The searches' `attention` argument, passed only when asked for (a decoder written
    before it still serves every other search)."""
    return {"attention": True} if attention else {}


def _check_pairs(what, given, sources):
    if given is not None and len(given) != len(sources):
        raise ValueError(
            f"{len(given)} {what} for {len(sources)} sentences: give one per sentence "
            "(an empty one for none)."
        )


class Translator:
    """Translation with any `decoder.Decoder`: ids or texts in, hypotheses or texts out.

    Args:
        decoder: an `OnnxDecoder`, a `KerasDecoder`, or any object with the
            `decoder.Decoder` methods.
        tokenizer: `encode(text) -> ids` and `decode(ids) -> text`, for the
            text-level methods (None: ids only).
    """

    def __init__(self, decoder, tokenizer=None):
        self.decoder = decoder
        self.tokenizer = tokenizer

    @property
    def max_length(self):
        """The positions the model trained on."""
        return self.decoder.max_length

    @property
    def vocabulary_size(self):
        return self.decoder.vocabulary_size

    # ----------------------------------------------------------------------- ids

    def _prepare(self, source_ids, max_length):
        source, lengths = source_array(source_ids, self.max_length, self.decoder.source_multiple)
        return source, output_limits(lengths, max_length, self.max_length)

    def greedy_search(self, source_ids, max_length=None, ignore_eos=False):
        """Greedy search: `(tokens, scores)`, by the rules of `spec.greedy`.

        Args:
            source_ids: int array `(batch_size, source_len)` padded with 0, or
                a list of token-id lists.
            max_length: the most tokens generated, EOS included; default each
                source's length + 50 (`sources.output_limits`).
            ignore_eos: never stop at EOS (for benchmarks).

        Returns:
            a list of int lists (no BOS, cut before EOS) and a float64 array of
            the summed log-probabilities, EOS included when produced.
        """
        source, limits = self._prepare(source_ids, max_length)
        tokens, scores, _ = self._plain(source, limits, 1, ignore_eos=ignore_eos)
        return [row[0] for row in tokens], np.array([row[0] for row in scores], np.float64)

    def beam_search(
        self, source_ids, beam_size=4, length_penalty=0.6, max_length=None, ignore_eos=False
    ):
        """Beam search: `(tokens, scores)`, by the rules of `spec.beam`.

        A hypothesis finishes at EOS and scores its summed log-probability
        (EOS included) divided by `spec.length_penalty_factor` of its length;
        a sentence stops when no live beam can beat its best finished one.

        Args:
            source_ids, max_length, ignore_eos: as for `greedy_search`.
            beam_size: beams kept per sentence (4 in the paper).
            length_penalty: alpha (0.6 in the paper); 0 disables it.

        Returns:
            the best hypothesis of each sentence as an int list and its
            length-penalized score (float64).
        """
        check_beam_arguments(beam_size, length_penalty)
        source, limits = self._prepare(source_ids, max_length)
        tokens, scores, _ = self._plain(source, limits, beam_size, length_penalty, ignore_eos)
        return [row[0] for row in tokens], np.array([row[0] for row in scores], np.float64)

    def _plain(
        self,
        source,
        limits,
        beam_size,
        length_penalty=0.6,
        ignore_eos=False,
        n_best=1,
        masks=NO_MASKS,
        length_penalty_form="gnmt",
        attention=False,
    ):
        """The plain search of a prepared batch under the stateless `masks`:
        `(tokens, scores, token_scores)`, per sentence a list of its `n_best` best
        hypotheses' (token scores: each step's, EOS included when produced). The
        decoder's graph-resident search where it has one; else the one loop.
        `ignore_eos` suppresses EOS: every output runs to its limit. With
        `attention`, a fourth list: the hypotheses' alignment weights where the
        fast search returned them, else None (`decoder.Decoder.beam`)."""
        if not limits.any():
            found = [[[]] for _ in limits], [[0.0] for _ in limits], [[[]] for _ in limits]
            return (*found, [[None] for _ in limits]) if attention else found
        if ignore_eos:
            masks = dataclasses.replace(masks, suppressed=(*masks.suppressed, EOS_ID))
        if beam_size == 1:
            found = self.decoder.greedy(source, limits, masks, **_asked(attention))
            if found is not None:
                tokens, steps, *weights = found  # one hypothesis each
                sums = [sum(row) for row in steps]
                return tuple([[x] for x in column] for column in (tokens, sums, steps, *weights))
        else:
            found = self.decoder.beam(
                source,
                limits,
                beam_size,
                length_penalty,
                n_best,
                masks,
                length_penalty_form,
                **_asked(attention),
            )
            if found is not None:
                return found
        options = SearchOptions(
            beam_size,
            length_penalty,
            n_best=n_best,
            token_scores=True,
            suppress_sequences=tuple((i,) for i in masks.suppressed),
            min_length=masks.min_length,
            length_penalty_form=length_penalty_form,
        )
        found = self._loop(source, limits, options)
        plain = (
            [[h.tokens for h in row] for row in found],
            [[h.score for h in row] for row in found],
            [[h.token_scores for h in row] for row in found],
        )
        return (*plain, [[None] * len(row) for row in found]) if attention else plain

    def _loop(self, source, limits, options, prefixes=None, indices=None, constraints=None):
        """`search.search_loop` over the decoder's cached step: the hypotheses of each source."""
        if not limits.any():
            return search_loop(
                None, None, limits, options, prefixes, indices, constraints=constraints
            )
        state = self.decoder.start(source, options.beam_size, int(limits.max()))
        return search_loop(
            state.step,
            state.reorder,
            limits,
            options,
            prefixes,
            indices,
            drop_finished=state.drops_finished,
            constraints=constraints,
            selects=getattr(state, "selects", False),
        )

    def search(self, source_ids, options=None, prefixes=None, indices=None, constraints=None):
        """`search_with_weights`' hypotheses alone."""
        return self.search_with_weights(source_ids, options, prefixes, indices, constraints)[0]

    def search_with_weights(
        self, source_ids, options=None, prefixes=None, indices=None, constraints=None, weights=False
    ):
        """The best hypotheses of each source under `options` (a `options.SearchOptions`),
        and their alignment weights.

        Args:
            source_ids: as for `greedy_search`.
            options: default `SearchOptions()` (beam 4).
            prefixes: per-sentence target prefix ids (forced first), or None.
            indices: each sentence's index in its input, which seeds its
                sampling (`spec.sentence_rng`); default 0, 1, ...
            constraints: per-sentence terminology constraints, each a list
                of target phrases as token-id lists (or a
                `constraints.Constraints`), or None: every output holds its
                phrases (`constrained_search.ConstrainedSearch`).

        Returns:
            per sentence, its `spec.Hypothesis` list (`options.n_best` at most),
            best first, with their `alignment` when `options.alignment` asks
            for it (`align_ids`). Plain options without prefixes or
            constraints run the decoder's fast search (`greedy_search`,
            `beam_search`), so options not used cost nothing; any other runs
            `search.search_loop`. Beside them, where `weights` or
            `options.alignment` asks: per sentence, per hypothesis, its alignment
            weights `(steps, source_len)` where the fast search returned them,
            else None (`Decoder.alignment_weights` then gives them); otherwise None.
        """
        options = options if options is not None else SearchOptions()
        sources = _id_lists(source_ids)
        if options.max_input_length is not None:
            sources = [truncate_source(row, options.max_input_length) for row in sources]
        _check_pairs("target prefixes", prefixes, sources)
        _check_pairs("constraint lists", constraints, sources)
        options.check_ids(self.vocabulary_size, prefixes)
        attention = weights or options.alignment
        found, rows = self._search(sources, options, prefixes, indices, constraints, attention)
        if attention and rows is None:  # the loop's hypotheses
            rows = [[None] * len(hypotheses) for hypotheses in found]
        if options.alignment:  # never changes the search
            add_alignments(found, sources, self.align_ids, rows)
        return found, rows

    def _search(self, sources, options, prefixes, indices, constraints, attention=False):
        """`search` once its arguments are checked (no alignments): `(found, weights)`,
        with `attention` the hypotheses' alignment weights where the fast search
        returned them (per sentence, per hypothesis, else None); without, None."""
        source, limits = self._prepare(sources, options.max_length)
        # The fast searches return each step's score and the n best hypotheses,
        # and take the stateless masks: those options cost nothing.
        plain = not any(prefixes or ()) and not any(map(len, constraints or ()))
        masks = options.graph_masks()
        if plain and masks is not None:
            found = self._plain(
                source,
                limits,
                options.beam_size,
                options.length_penalty,
                n_best=options.n_best,
                masks=masks,
                length_penalty_form=options.length_penalty_form,
                attention=attention,
            )
            return plain_hypotheses(*found[:3], limits, options), found[3] if attention else None
        limits = prefixed_limits(limits, prefixes, options.max_length)
        return self._loop(source, limits, options, prefixes, indices, constraints), None

    def score_ids(self, source_ids, target_ids):
        """Forced decoding: per sentence `(log_prob, token_scores)` of `target_ids[i]`
        (no BOS, no EOS) given `source_ids[i]`, EOS scored last.

        The scores are the model's log-probabilities, no option applied; an
        empty source scores `(None, None)`.
        """
        sources = _id_lists(source_ids)
        if len(sources) != len(target_ids):
            raise ValueError(
                f"{len(target_ids)} targets for {len(sources)} sources: give one each."
            )
        found = [(None, None)] * len(sources)
        rows = [i for i, source in enumerate(sources) if len(source)]
        if not rows:
            return found
        source, _ = source_array(
            [sources[i] for i in rows], self.max_length, self.decoder.source_multiple
        )
        targets = [[int(t) for t in target_ids[i]] for i in rows]
        log_probs = self.decoder.label_log_probs(
            source, teacher_inputs(targets), teacher_labels(targets)
        )
        for i, row, target in zip(rows, log_probs, targets, strict=True):
            steps = row[: len(target) + 1].tolist()  # EOS scored last
            found[i] = (sum(steps), steps)
        return found

    def align_ids(self, source_ids, target_ids):
        """Per sentence, the source position each token of `target_ids[i]` attends to
        most (`spec.alignments` of `Decoder.alignment_weights`)."""
        sources = _id_lists(source_ids)
        if len(sources) != len(target_ids):
            raise ValueError(
                f"{len(target_ids)} targets for {len(sources)} sources: give one each."
            )
        if not sources:
            return []
        source, lengths = source_array(sources, self.max_length, self.decoder.source_multiple)
        targets = [[int(t) for t in target] for target in target_ids]
        weights = self.decoder.alignment_weights(source, teacher_inputs(targets))
        return alignments(weights, lengths, [len(t) for t in targets])

    # ----------------------------------------------------------------------- texts

    def _checked_texts(self, sentences, name="sentences"):
        if isinstance(sentences, str):
            raise TypeError(f"{name} must be a list of strings, not one string.")
        if self.tokenizer is None:
            raise ExportFileError("This translator has no tokenizer: it translates ids only.")
        sentences = list(sentences)
        for i, text in enumerate(sentences):
            if not isinstance(text, str):
                raise TypeError(f"Sentence {i} is a {type(text).__name__}, not a string.")
        return sentences

    def _parallel(self, count, beam_size):
        """A queue of `count` translators for as many searches at once (`Decoder.parallel`)."""
        free = queue.SimpleQueue()
        for decoder in self.decoder.parallel(count, beam_size):
            free.put(self if decoder is self.decoder else Translator(decoder, self.tokenizer))
        return free

    def translate_hypotheses(
        self,
        sentences,
        options=None,
        prefixes=None,
        batch_size=32,
        progress=False,
        warn=None,
        constraints=None,
        parallel_batches=1,
    ):
        """Translates strings under `options`: per sentence a list of dicts, best first,
        with `text`, `score`, `log_prob` (and `token_scores`, `alignment` when asked for).

        `prefixes` are target-side texts, one per sentence ("" for none), each
        forced at the start of its translation; one with a word the vocabulary
        lacks is refused. `constraints`, one entry per sentence (a list of
        target phrases, or None or `[]` for none), makes every translation
        hold its phrases (docs/constraints.md); a phrase that tokenizes to
        nothing or to the unknown token, or that cannot fit in its
        sentence's output, raises a `ValueError` naming it and its line
        before anything is translated. Batching, order, long sentences and
        `parallel_batches`: as `translate`.
        """
        options = options if options is not None else SearchOptions()
        sentences = self._checked_texts(sentences)
        found = self._text_hypotheses(
            sentences, options, prefixes, batch_size, progress, warn, constraints, parallel_batches
        )
        return [hypothesis_records(hypotheses, self.tokenizer.decode) for hypotheses in found]

    def _text_hypotheses(
        self,
        sentences,
        options,
        prefixes,
        batch_size,
        progress,
        warn,
        constraints,
        parallel_batches,
        linked=None,
    ):
        """`translate_hypotheses`' search: per sentence its `spec.Hypothesis` list.

        `linked[i]` true adds `(hypotheses, links)` for sentence i instead: the
        `word_links` of its best hypothesis, read in its batch right after the
        search (the encoder's output is reused)."""
        check_positive_int("parallel_batches", parallel_batches)
        prefix_ids = None
        if prefixes is not None:
            prefixes = self._checked_texts(prefixes, "prefixes")
            if len(prefixes) != len(sentences):
                raise ValueError(f"{len(prefixes)} prefixes for {len(sentences)} sentences.")
            prefix_ids = encode_prefixes(self.tokenizer, prefixes, options.max_length)
        phrases = None
        if constraints is not None:
            phrases = sentence_constraints(
                sentences,
                constraints,
                self.tokenizer.encode,
                self.max_length,
                options.max_length,
                continuations=word_continuations(self.tokenizer),
                encode_target=self.tokenizer.encode_target,
            )
        free = self._parallel(parallel_batches, options.beam_size)

        def search(sources, indices):
            chosen = None if prefix_ids is None else [prefix_ids[i] for i in indices]
            chosen_phrases = None if phrases is None else [phrases[i] for i in indices]
            translator = free.get()
            try:
                tagged = linked is not None and any(linked[i] for i in indices)
                found, rows = translator.search_with_weights(
                    sources, options, chosen, indices, chosen_phrases, weights=tagged
                )
                if not tagged:
                    return found
                links = sentence_links(
                    translator,
                    [sentences[i] for i in indices],
                    [h[0].tokens for h in found],
                    sources,
                    [row[0] for row in rows],
                )
                return [
                    (hypotheses, row) if linked[i] else hypotheses
                    for i, hypotheses, row in zip(indices, found, links, strict=True)
                ]
            finally:
                free.put(translator)

        return search_texts(
            sentences,
            self.tokenizer.encode,
            search,
            self.max_length,
            batch_size=batch_size,
            progress=progress,
            warn=warn,
            parallel_batches=parallel_batches,
            max_input_length=options.max_input_length,
        )

    def translate(
        self,
        sentences,
        beam_size=4,
        max_length=None,
        batch_size=32,
        progress=False,
        warn=None,
        length_penalty=0.6,
        parallel_batches=1,
        options=None,
        prefixes=None,
        constraints=None,
    ):
        """Translates a list of strings; `beam_size=1` is greedy search.

        `options` (a `options.SearchOptions`), when given, replaces `beam_size`,
        `length_penalty` and `max_length`. `prefixes` (target texts) and
        `constraints` (per sentence, target phrases every translation must
        hold; docs/constraints.md) are `translate_hypotheses`'s; the best
        text is kept.

        `parallel_batches` > 1 searches that many batches at once, each on
        its own thread, whatever the options (`Decoder.parallel` gives each
        its decoder). Sentences are sorted by length into batches and put
        back in order. An empty (or whitespace-only) string gives an empty
        string; a sentence longer than the model's `max_length` is
        translated whole; `warn(message)` hears about each one
        (`text_batches.search_texts`).
        """
        if isinstance(sentences, str):
            raise TypeError("translate takes a list of strings, not one string.")
        if options is None:
            check_beam_arguments(beam_size, length_penalty)
            options = SearchOptions(beam_size, length_penalty, max_length=max_length)
        found = self.translate_hypotheses(
            sentences, options, prefixes, batch_size, progress, warn, constraints, parallel_batches
        )
        return [hypotheses[0]["text"] for hypotheses in found]

    def documents(self, texts, input_format="paragraphs", language=None, max_input_length=None):
        """The `documents.Document` of each text in `input_format`, its sentences
        split by the rules of `language` (default the export's source language,
        else "en"), those longer than `max_input_length` tokens (EOS included)
        cut at spaces into pieces that fit."""
        texts = self._checked_texts(texts, "texts")
        language = language or getattr(self.decoder, "source_language", None) or "en"
        split_long = None
        if max_input_length is not None:
            encode = self.tokenizer.encode

            def count(text):
                return len(encode(text)) + 1

            split_long = (count, max_input_length)
        return [parse_document(text, input_format, language, split_long) for text in texts]

    def translate_documents(
        self,
        texts,
        input_format="paragraphs",
        options=None,
        language=None,
        batch_size=32,
        progress=False,
        warn=None,
        parallel_batches=1,
        terms=None,
    ):
        """Translates whole texts in `input_format` (`documents.INPUT_FORMATS`), one
        translated text each: every sentence is translated under `options` (its
        sentences share batches with the other texts'), and the text is rebuilt
        around them (docs/documents.md). n-best lists, token scores and
        alignments belong to sentences, not documents: ask `translate_hypotheses`.

        `terms`, a glossary of `(source term, target phrase)` pairs (or a
        dict), constrains each sentence that holds a source term to hold its
        target phrase (`documents.sentence_terms`; docs/constraints.md)."""
        options = options if options is not None else SearchOptions()
        for name, given in (
            ("n_best", options.n_best > 1),
            ("token_scores", options.token_scores),
            ("alignment", options.alignment),
        ):
            if given:
                raise ValueError(
                    f"{name}={getattr(options, name)} is for sentences (input format text): "
                    "a document translates to one text."
                )
        docs = self.documents(texts, input_format, language, options.max_input_length)
        sentences = [sentence for document in docs for sentence in document.sentences]
        tagged = [flag for document in docs for flag in document.tagged]
        located = sentence_places(docs)
        if warn is not None:
            told = warn

            def warn(message):
                told(located(message))

        phrases = sentence_terms(sentences, terms) if terms else None
        try:
            found = self._text_hypotheses(
                sentences,
                options,
                None,
                batch_size,
                progress,
                warn,
                phrases,
                parallel_batches,
                linked=tagged,  # where their inline tags go
            )
        except ValueError as error:  # a constraint that cannot be held, by its place
            raise ValueError(located(str(error))) from None
        links = [row[1] if flag else None for row, flag in zip(found, tagged, strict=True)]
        found = [row[0] if flag else row for row, flag in zip(found, tagged, strict=True)]
        translations = [self.tokenizer.decode(hypotheses[0].tokens) for hypotheses in found]
        return rebuild_documents(docs, translations, links)

    def score(self, sources, targets, batch_size=32, progress=False, warn=None):
        """Forced decoding of texts: per pair a dict of `log_prob` (summed, EOS included)
        and `token_scores` (None for an empty source). See `score_ids`."""
        sources = self._checked_texts(sources, "sources")
        targets = self._checked_texts(targets, "targets")
        if len(sources) != len(targets):
            raise ValueError(f"{len(targets)} targets for {len(sources)} sources.")

        def search(batch, indices):
            target_ids = [self.tokenizer.encode_target(targets[i]) for i in indices]
            return self.score_ids(batch, target_ids)

        found = search_texts(
            sources, self.tokenizer.encode, search, self.max_length, batch_size, progress, warn
        )
        return [{"log_prob": total, "token_scores": steps} for total, steps in found]
