"""Greedy and beam search over a model from `build_transformer`, with a key/value cache.

The decoder runs one position at a time. Each decoder layer keeps a
self-attention cache of keys and values, preallocated at the longest output of
the call; the cross-attention keys and values of the encoder output are
computed once per sentence. The step is compiled (`tf.function` on
TensorFlow, `jax.jit` on JAX) and traced once per batch shape.

`use_cache=False` re-runs the whole decoder over the growing output at every
step. It is the reference the cached search is tested against. Both follow
the search specification, `keras_transformer_runtime.spec`, as the ONNX
Runtime translator does; the tests check each against it.

Conventions: padding id 0, BOS 1, EOS 2. Returned token ids exclude BOS and
stop before EOS. A source longer than the model's `max_length` raises a
`ValueError` (it is never truncated). An empty source (no non-padding token)
gives an empty output with score 0.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
from keras import ops
from keras_transformer_runtime.search import (
    EXTRA_OUTPUT_TOKENS,
    add_alignments,
    banned_ids,
    beam_loop,
    check_beam_arguments,
    forced_scores,
    greedy_loop,
    length_penalty_factor,
    options_loop,
    output_limits,
    plain_hypotheses,
    prefixed_limits,
    source_array,
    teacher_inputs,
)
from keras_transformer_runtime.spec import (
    SearchOptions,
    alignment_layer,
    alignments,
    truncate_source,
)
from keras_transformer_runtime.specials import BOS_ID, EOS_ID, PAD_ID

from keras_transformer.model import TransformerParts, transformer_parts
from keras_transformer.startup import DropMessages

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "EXTRA_OUTPUT_TOKENS",
    "PAD_ID",
    "align",
    "beam_search",
    "greedy_search",
    "length_penalty_factor",
    "score",
    "search",
    "sequence_log_probs",
]

# Hides TensorFlow's retracing warning for the decoder's own compiled functions (see _compile).
_RETRACING = DropMessages("_Decoder.", "triggered tf.function retracing")


def _as_source_array(source_ids, model_max_length):
    if ops.is_tensor(source_ids):
        source_ids = np.asarray(ops.convert_to_numpy(source_ids))
    return source_array(source_ids, model_max_length)


# --------------------------------------------------------------------------- compiled steps


class _Decoder:
    """Compiled encoder, cached decoder step and uncached decoder for one model."""

    def __init__(self, model):
        self.model = model
        self.parts: TransformerParts = transformer_parts(model)
        self.config = self.parts.config
        self.backend = keras.backend.backend()
        self._encode = self._compile(self._encode_fn, relax_shapes=True)
        self._step = self._compile(self._step_fn, xla=True)
        self._greedy = self._compile(self._greedy_fn, xla=True)
        self._full = self._compile(self._full_fn, relax_shapes=True)

    # Plain functions of tensors, compiled below.
    def _encode_fn(self, source_ids):
        encoded, mask = self.parts.encode(source_ids)
        caches = [
            layer.cross_attention.compute_key_value_cache(encoded)
            for layer in self.parts.decoder_layers
        ]
        return encoded, mask, caches

    def _step_fn(self, token_ids, index, self_caches, cross_caches, source_mask):
        y = self.parts.target_embedding(token_ids, start_index=index)
        new_caches = []
        for layer, self_cache, cross_cache in zip(
            self.parts.decoder_layers, self_caches, cross_caches, strict=True
        ):
            y, self_cache, _ = layer(
                y,
                encoder_padding_mask=source_mask,
                self_attention_cache=self_cache,
                self_attention_cache_update_index=index,
                cross_attention_cache=cross_cache,
            )
            new_caches.append(self_cache)
        logits = self.parts.project(y)[:, 0]  # (B, V)
        return ops.log_softmax(logits, axis=-1), new_caches

    def _full_fn(self, target_ids, encoded, source_mask, position):
        hidden = self.parts.decode_hidden(target_ids, encoded, source_mask)
        newest = ops.take(hidden, ops.reshape(position, (1,)), axis=1)  # (B, 1, D)
        logits = self.parts.project(newest)[:, 0]  # only the newest position
        return ops.log_softmax(logits, axis=-1)

    def _greedy_fn(self, source_mask, cross_caches, self_caches, limits, banned):
        """The whole cached greedy loop as one compiled while-loop.

        Returns the generated ids `(batch, steps)` (EOS included, zeros after
        it) and the summed log-probabilities `(batch,)`.
        """
        batch = ops.shape(source_mask)[0]
        steps = self_caches[0].shape[2]

        def cond(t, tokens, scores, done, last, caches):
            return ops.logical_and(ops.less(t, steps), ops.logical_not(ops.all(done)))

        def body(t, tokens, scores, done, last, caches):
            log_probs, caches = self._step_fn(last, t, caches, cross_caches, source_mask)
            next_ids = ops.cast(ops.argmax(log_probs + banned, axis=-1), "int32")  # (B,)
            picked = ops.take_along_axis(log_probs, next_ids[:, None], axis=-1)[:, 0]
            live = ops.logical_not(done)
            scores = scores + ops.where(live, picked, 0.0)
            written = ops.where(live, next_ids, 0)[:, None]
            tokens = ops.slice_update(tokens, (0, t), written)
            ended = ops.logical_or(ops.equal(next_ids, EOS_ID), ops.greater_equal(t + 1, limits))
            done = ops.logical_or(done, ended)
            last = ops.where(done, EOS_ID, next_ids)[:, None]
            return t + 1, tokens, scores, done, last, caches

        state = (
            ops.convert_to_tensor(0, "int32"),
            ops.zeros((batch, steps), "int32"),
            ops.zeros((batch,), "float32"),
            ops.less_equal(limits, 0),
            ops.full((batch, 1), BOS_ID, "int32"),
            list(self_caches),
        )
        _, tokens, scores, _, _, _ = ops.while_loop(cond, body, state)
        return tokens, scores

    def _compile(self, fn, relax_shapes=False, xla=False):
        if self.backend == "tensorflow":
            import tensorflow as tf

            # XLA fuses the small ops of one decoder step; the shapes of the
            # cached step are fixed per call, so it compiles once per batch
            # shape, by design: TensorFlow's warning about retracing would only
            # mislead.
            logging.getLogger("tensorflow").addFilter(_RETRACING)
            return tf.function(fn, reduce_retracing=relax_shapes, jit_compile=xla)
        if self.backend == "jax":
            import jax

            variables = self.model.variables

            def stateless(values, *args):
                mapping = list(zip(variables, values, strict=True))
                with keras.StatelessScope(state_mapping=mapping):
                    return fn(*args)

            jitted = jax.jit(stateless)
            return lambda *args: jitted([v.value for v in variables], *args)
        return fn

    def empty_self_caches(self, batch_size, length):
        c = self.config
        shape = (batch_size, 2, length, c.num_heads, c.hidden_dim // c.num_heads)
        dtype = self.parts.decoder_layers[0].compute_dtype
        return [ops.zeros(shape, dtype) for _ in range(c.num_layers)]


def _decoder_for(model) -> _Decoder:
    decoder = getattr(model, "_keras_transformer_decoder", None)
    if decoder is None or decoder.model is not model:
        decoder = _Decoder(model)
        # Cached on the model: the compiled functions are traced once per shape.
        object.__setattr__(model, "_keras_transformer_decoder", decoder)
    return decoder


def _to_numpy(x):
    return np.asarray(ops.convert_to_numpy(x))


# --------------------------------------------------------------------------- greedy


def greedy_search(model, source_ids, max_length=None, use_cache=True, ignore_eos=False):
    """Greedy decoding, batched.

    Args:
        model: a model from `build_transformer` (or loaded from a `.keras` file).
        source_ids: int array `(batch_size, source_len)` padded with 0, or a
            list of token-id lists.
        max_length: maximum number of generated tokens (EOS included);
            defaults to each source's length + 50, capped by the model's
            `max_length`.
        use_cache: False re-runs the full decoder at each step (reference).
        ignore_eos: never stop at EOS; every output gets its maximum length
            (for benchmarks).

    Returns:
        `(tokens, scores)`: a list of int lists (no BOS, cut before EOS) and a
        float64 array of the summed log-probabilities of each output,
        EOS included when it was produced.
    """
    decoder = _decoder_for(model)
    cap = decoder.config.max_length
    source, lengths = _as_source_array(source_ids, cap)
    limits = output_limits(lengths, max_length, cap)
    batch = len(source)
    if (limits == 0).all():  # only empty sources
        return greedy_loop(None, limits)

    encoded, source_mask, cross_caches = decoder._encode(ops.convert_to_tensor(source))
    steps = int(limits.max())
    if use_cache:
        banned = np.zeros(decoder.config.vocabulary_size, np.float32)
        banned[banned_ids(ignore_eos)] = -np.inf
        ids, sums = decoder._greedy(
            source_mask,
            cross_caches,
            decoder.empty_self_caches(batch, -(-steps // 8) * 8),
            ops.convert_to_tensor(limits.astype(np.int32)),
            ops.convert_to_tensor(banned),
        )
        ids = _to_numpy(ids)
        outputs = []
        for i in range(batch):
            row = [int(x) for x in ids[i, : limits[i]]]
            outputs.append(row[: row.index(EOS_ID)] if EOS_ID in row else row)
        return outputs, _to_numpy(sums).astype(np.float64)

    def full_step(inputs, t):
        # jax.jit compiles once per shape: grow the input in blocks of 8 there.
        # Positions after t are padding, which the causal mask keeps out of t.
        width = -(-(t + 1) // 8) * 8 if decoder.backend == "jax" else t + 1
        padded = np.zeros((batch, width), np.int32)
        padded[:, : t + 1] = inputs
        log_probs = decoder._full(
            ops.convert_to_tensor(padded),
            encoded,
            source_mask,
            ops.convert_to_tensor(t, "int32"),
        )
        return _to_numpy(log_probs)

    return greedy_loop(full_step, limits, ignore_eos)


# --------------------------------------------------------------------------- beam search


def beam_search(
    model, source_ids, beam_size=4, length_penalty=0.6, max_length=None, ignore_eos=False
):
    """Beam search with the length penalty ((5 + len) / 6) ** length_penalty, batched.

    A hypothesis is finished when it produces EOS; its score is its summed
    log-probability (EOS included) divided by the length penalty of its
    length (EOS included). A sentence is done when no live beam can still
    beat its best finished hypothesis (bounded with the penalty of the
    maximum length), or when `beam_size` hypotheses have finished and no live
    beam beats the best at its current length, or at its maximum length
    (live beams are then scored as they are).

    Args:
        model: a model from `build_transformer` (or loaded from a `.keras` file).
        source_ids: int array `(batch_size, source_len)` padded with 0, or a
            list of token-id lists.
        beam_size: int >= 1. Beams kept per sentence (4 in the paper).
        length_penalty: float alpha (0.6 in the paper); 0 disables it.
        max_length: maximum number of generated tokens (EOS included);
            defaults to each source's length + 50, capped by the model's
            `max_length`.
        ignore_eos: never finish at EOS; every output gets its maximum length
            (for benchmarks).

    Returns:
        `(tokens, scores)`: the best hypothesis of each sentence as an int list
        (no BOS, cut before EOS), and its length-penalized score (float64).
    """
    check_beam_arguments(beam_size, length_penalty)
    decoder = _decoder_for(model)
    cap = decoder.config.max_length
    source, lengths = _as_source_array(source_ids, cap)
    limits = output_limits(lengths, max_length, cap)
    if (limits == 0).all():
        return beam_loop(None, None, limits, beam_size, length_penalty, ignore_eos)

    step, reorder = _tiled_steps(decoder, source, beam_size, limits)
    return beam_loop(step, reorder, limits, beam_size, length_penalty, ignore_eos)


def _tiled_steps(decoder, source, k, limits):
    """`(step, reorder)` over `k` hypotheses per sentence, for the numpy search loops.

    Every sentence is repeated k times: row b * k + j is hypothesis j of
    sentence b. `step(last, t)` gives the log-probabilities of the next token
    (numpy) and advances the self-attention caches; `reorder(rows)` makes
    row i continue hypothesis `rows[i]`.
    """
    tiled = np.repeat(source, k, axis=0)
    _, source_mask, cross_caches = decoder._encode(ops.convert_to_tensor(tiled))
    steps = int(limits.max())
    state = {"caches": decoder.empty_self_caches(len(tiled), -(-steps // 8) * 8)}

    def step(last, t):
        log_probs, state["caches"] = decoder._step(
            ops.convert_to_tensor(last[:, None]),
            ops.convert_to_tensor(t, "int32"),
            state["caches"],
            cross_caches,
            source_mask,
        )
        return _to_numpy(log_probs)

    def reorder(rows):
        rows = ops.convert_to_tensor(rows)
        state["caches"] = [ops.take(cache, rows, axis=0) for cache in state["caches"]]

    return step, reorder


def search(model, source_ids, options=None, prefixes=None, indices=None, constraints=None):
    """The best hypotheses of each source under `options` (a `SearchOptions`).

    The same search as `OnnxTranslator.search`, by the rules of
    `keras_transformer_runtime.spec.SentenceSearch`: plain options without
    prefixes run `greedy_search` / `beam_search`; any other runs
    `search.options_loop` over the cached decoder step (one compiled shape:
    `beam_size` rows per sentence).

    Args:
        model: a model from `build_transformer`.
        source_ids: as for `greedy_search`.
        options: default `SearchOptions()` (beam 4).
        prefixes: per-sentence target prefix ids, or None.
        indices: each sentence's index in its input, which seeds its sampling.
        constraints: per-sentence terminology constraints (lists of target
            phrases as token-id lists), or None: every output holds its
            phrases (`keras_transformer_runtime.constraints`).

    Returns:
        per sentence, its `spec.Hypothesis` list (`options.n_best` at most), best
        first, with their `alignment` when `options.alignment` asks for it (`align`).
    """
    options = options if options is not None else SearchOptions()
    cap = transformer_parts(model).config.max_length
    if options.max_input_length is not None:
        source, _ = _as_source_array(source_ids, cap)
        rows = [row[row != PAD_ID].tolist() for row in source]
        source_ids = [truncate_source(row, options.max_input_length) for row in rows]
    found = _search(model, source_ids, options, prefixes, indices, constraints)
    if options.alignment:  # read after the search: it never changes the search
        add_alignments(found, source_ids, lambda s, t: align(model, s, t))
    return found


def _search(model, source_ids, options, prefixes, indices, constraints):
    """`search` once the sources are truncated (no alignments)."""
    decoder = _decoder_for(model)
    cap = decoder.config.max_length
    if prefixes is not None and len(prefixes) != len(source_ids):
        raise ValueError(f"{len(prefixes)} target prefixes for {len(source_ids)} sentences.")
    options.check_ids(decoder.config.vocabulary_size, prefixes)
    source, lengths = _as_source_array(source_ids, cap)
    limits = output_limits(lengths, options.max_length, cap)
    if constraints is not None and len(constraints) != len(source_ids):
        raise ValueError(f"{len(constraints)} constraint lists for {len(source_ids)} sentences.")
    if options.is_plain() and not any(prefixes or ()) and not any(map(len, constraints or ())):
        if options.beam_size == 1:
            found = greedy_search(model, source, max_length=options.max_length)
        else:
            found = beam_search(
                model,
                source,
                beam_size=options.beam_size,
                length_penalty=options.length_penalty,
                max_length=options.max_length,
            )
        return plain_hypotheses(*found, limits, options)
    limits = prefixed_limits(limits, prefixes, options.max_length)
    if (limits == 0).all():
        return options_loop(None, None, limits, options, prefixes, indices, constraints=constraints)
    step, reorder = _tiled_steps(decoder, source, options.beam_size, limits)
    return options_loop(step, reorder, limits, options, prefixes, indices, constraints=constraints)


def score(model, source_ids, target_ids):
    """Forced decoding: per sentence `(log_prob, token_scores)` of `target_ids[i]`
    (no BOS, no EOS) given `source_ids[i]`, EOS scored last; `(None, None)` for
    an empty source. The model's log-probabilities, as `OnnxTranslator.score_ids`."""
    if len(source_ids) != len(target_ids):
        raise ValueError(f"{len(target_ids)} targets for {len(source_ids)} sources.")
    parts = transformer_parts(model)
    source, lengths = _as_source_array(source_ids, parts.config.max_length)
    found = [(None, None)] * len(source)
    rows = np.flatnonzero(lengths)
    if not len(rows):
        return found
    targets = [[int(t) for t in target_ids[i]] for i in rows]
    logits = model(
        {"source_ids": source[rows], "target_ids": teacher_inputs(targets)}, training=False
    )
    log_probs = _to_numpy(ops.log_softmax(ops.cast(logits, "float32"), axis=-1))
    for i, result in zip(rows, forced_scores(log_probs.astype(np.float64), targets), strict=True):
        found[i] = result
    return found


def align(model, source_ids, target_ids):
    """Per sentence, the source position each token of `target_ids[i]` attends to most:
    `spec.alignments` of the cross-attention of `spec.alignment_layer`, averaged
    over heads, teacher-forced, as `OnnxTranslator.align_ids`."""
    if len(source_ids) != len(target_ids):
        raise ValueError(f"{len(target_ids)} targets for {len(source_ids)} sources.")
    if not len(source_ids):
        return []
    parts = transformer_parts(model)
    source, lengths = _as_source_array(source_ids, parts.config.max_length)
    targets = [[int(t) for t in target] for target in target_ids]
    _, weights = parts.logits_and_cross_attention(source, teacher_inputs(targets))
    layer = _to_numpy(weights[alignment_layer(parts.config.num_layers)])  # (B, N, T, S)
    return alignments(layer.mean(1), lengths, [len(t) for t in targets])


def sequence_log_probs(model, source_ids, target_tokens, ended=True):
    """Summed log-probabilities the full (uncached) model assigns to outputs.

    Args:
        model: a model from `build_transformer`.
        source_ids: as for `greedy_search`.
        target_tokens: a list of int lists (no BOS, no EOS).
        ended: bool or list of bools; True adds the log-probability of EOS
            after each output.

    Returns:
        float64 array `(batch_size,)`.
    """
    parts = transformer_parts(model)
    source, _ = _as_source_array(source_ids, parts.config.max_length)
    if isinstance(ended, bool):
        ended = [ended] * len(target_tokens)
    sequences = [
        list(tokens) + [EOS_ID] if has_eos else list(tokens)
        for tokens, has_eos in zip(target_tokens, ended, strict=True)
    ]
    width = max(1, max(len(seq) for seq in sequences))
    decoder_input = np.zeros((len(sequences), width), np.int32)
    labels = np.zeros_like(decoder_input)
    for i, seq in enumerate(sequences):
        decoder_input[i, : max(len(seq), 1)] = [BOS_ID, *seq[:-1]]
        labels[i, : len(seq)] = seq
    logits = model({"source_ids": source, "target_ids": decoder_input}, training=False)
    log_probs = _to_numpy(ops.log_softmax(logits, axis=-1)).astype(np.float64)
    picked = np.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    return (picked * (labels != PAD_ID)).sum(-1)
