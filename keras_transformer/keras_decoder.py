"""The Keras decoder: a model from `build_transformer` behind the runtime's `Decoder` interface.

`KerasDecoder(model)` gives `keras_transformer_runtime.translator.Translator`
what it needs (encode, a cached step, reorder, forced log-probabilities,
cross-attention), so the Keras layers and the ONNX export share one
translation core. The decoder runs one position at a time: each decoder
layer keeps a self-attention cache of keys and values, preallocated at the
longest output of the call; the cross-attention keys and values are
computed once per sentence. The step and the greedy loop are compiled
(`tf.function` with XLA on TensorFlow, `jax.jit` on JAX) and traced once
per batch shape. `use_cache=False` re-runs the whole decoder over the
growing output at every step: the reference the cached step is tested
against.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
from keras import ops
from keras_transformer_runtime.options import NO_MASKS
from keras_transformer_runtime.spec import alignment_layer, banned_ids
from keras_transformer_runtime.specials import BOS_ID, EOS_ID

from keras_transformer.data.pipeline import BATCH_SHAPES
from keras_transformer.model import TransformerParts, transformer_parts
from keras_transformer.startup import DropMessages

# Hides TensorFlow's retracing warning for the decoder's own compiled functions (see _compile).
_RETRACING = DropMessages("CompiledSteps.", "triggered tf.function retracing")


def to_numpy(x):
    return np.asarray(ops.convert_to_numpy(x))


class CompiledSteps:
    """The compiled encoder, cached decoder step, greedy loop and uncached decoder of a model.

    Made once per model (`compiled_steps`): each compiled function is traced
    once per shape.
    """

    def __init__(self, model):
        self.model = model
        self.parts: TransformerParts = transformer_parts(model)
        self.config = self.parts.config
        self.backend = keras.backend.backend()
        self.encode = self._compile(self._encode_fn, relax_shapes=True)
        self.step = self._compile(self._step_fn, xla=True)
        self.greedy = self._compile(self._greedy_fn, xla=True)
        self.full = self._compile(self._full_fn, relax_shapes=True)

    # Plain functions of tensors, compiled above.
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
        """The whole cached greedy search as one compiled while-loop, by the rules of
        `spec.greedy` (the graph-resident fast path; the tests check it against them).

        Returns the generated ids `(batch, steps)` (EOS included, zeros after
        it) and their log-probabilities `(batch, steps)` (zeros after EOS).
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
            scores = ops.slice_update(scores, (0, t), ops.where(live, picked, 0.0)[:, None])
            written = ops.where(live, next_ids, 0)[:, None]
            tokens = ops.slice_update(tokens, (0, t), written)
            ended = ops.logical_or(ops.equal(next_ids, EOS_ID), ops.greater_equal(t + 1, limits))
            done = ops.logical_or(done, ended)
            last = ops.where(done, EOS_ID, next_ids)[:, None]
            return t + 1, tokens, scores, done, last, caches

        state = (
            ops.convert_to_tensor(0, "int32"),
            ops.zeros((batch, steps), "int32"),
            ops.zeros((batch, steps), "float32"),
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
        return [ops.zeros(shape, dtype) for _ in range(c.num_decoder_layers)]


def compiled_steps(model) -> CompiledSteps:
    """The model's `CompiledSteps`, made on first use and kept on the model."""
    steps = getattr(model, "_keras_transformer_steps", None)
    if steps is None or steps.model is not model:
        steps = CompiledSteps(model)
        object.__setattr__(model, "_keras_transformer_steps", steps)
    return steps


def compiled_length(n: int, limit: int) -> int:
    """`n` positions rounded up to a length bucket of the `few` batch shapes (8, 10, 12, 15,
    19, 24, ..., 25% apart) but not past `limit` (the model's positions), so that the
    compiled steps see few distinct shapes. Not the evaluated shapes' buckets twice
    apart: their extra padding made every warm decode slower, while fewer compiles
    help only the first (docs/performance.md, "JAX on a CPU")."""
    return next((b for b in BATCH_SHAPES["few"].boundaries(limit) if b >= n), n)


def compiled_rows(n: int) -> int:
    """`n` rows rounded up to a power of two, for the same reason."""
    return 1 << max(0, int(n) - 1).bit_length()


def _padded(source, rows, width):
    """`source` (B, S) with empty rows and padding columns up to `(rows, width)`."""
    padded = np.zeros((rows, width), source.dtype)
    padded[: source.shape[0], : source.shape[1]] = source
    return padded


class KerasDecoder:
    """A model from `build_transformer` as a `keras_transformer_runtime.decoder.Decoder`.

    Args:
        model: a model from `build_transformer` (or loaded from a `.keras` file).
        use_cache: False re-runs the full decoder at every step (the reference).

    Example:

    >>> import keras_transformer as kt
    >>> from keras_transformer_runtime.translator import Translator
    >>> model = kt.build_transformer(kt.TransformerConfig.from_preset("tiny", vocabulary_size=32))
    >>> tokens, scores = Translator(KerasDecoder(model)).greedy_search([[5, 6, 2]], max_length=3)
    >>> len(tokens[0]) <= 3
    True
    """

    source_multiple = 8  # few compiled source shapes

    def __init__(self, model, use_cache=True):
        self.steps = compiled_steps(model)
        self.use_cache = use_cache
        self.max_length = self.steps.config.max_length
        self.vocabulary_size = self.steps.config.vocabulary_size

    def start(self, source, rows, steps):
        """Every sentence repeated `rows` times (row b * rows + j is hypothesis j of b);
        the self-attention caches hold `steps` positions, rounded up by `compiled_length`."""
        tiled = np.repeat(source, rows, axis=0)
        if self.use_cache:
            return _CachedState(self.steps, tiled, compiled_length(steps, self.max_length))
        return _FullState(self.steps, tiled)

    def greedy(self, source, limits, masks=NO_MASKS, attention=False):
        """The compiled greedy loop: `(tokens, token_scores)`, its mask the padding, BOS
        and `masks.suppressed` (None with `use_cache=False`, the reference, or a
        minimum length: the search loop runs those); with `attention`, no alignment
        weights (a list of None: the translator aligns with `alignment_weights`)."""
        if not self.use_cache or masks.min_length:
            return None
        steps = self.steps
        # Empty rows (limit 0: done from the start) and padding up to few shapes.
        rows = compiled_rows(len(source))
        source = _padded(source, rows, compiled_length(source.shape[1], self.max_length))
        padded_limits = np.zeros(rows, np.int32)
        padded_limits[: len(limits)] = limits
        _, source_mask, cross_caches = steps.encode(ops.convert_to_tensor(source))
        mask = np.zeros(self.vocabulary_size, np.float32)
        mask[banned_ids() + list(masks.suppressed)] = -np.inf
        ids, step_scores = steps.greedy(
            source_mask,
            cross_caches,
            steps.empty_self_caches(rows, compiled_length(limits.max(), self.max_length)),
            ops.convert_to_tensor(padded_limits),
            ops.convert_to_tensor(mask),
        )
        ids, step_scores = to_numpy(ids), to_numpy(step_scores).astype(np.float64)
        outputs, token_scores = [], []
        for i in range(len(limits)):
            row = [int(x) for x in ids[i, : limits[i]]]
            taken = row.index(EOS_ID) + 1 if EOS_ID in row else len(row)  # EOS included
            outputs.append(row[: taken - 1] if EOS_ID in row else row)
            token_scores.append(step_scores[i, :taken].tolist())
        if attention:
            return outputs, token_scores, [None] * len(outputs)
        return outputs, token_scores

    def beam(self, *args, **kwargs):
        """None, whatever the search (`decoder.Decoder.beam`'s arguments): beam search
        runs the one loop over the compiled step."""
        return None

    def label_log_probs(self, source, target_inputs, labels):
        logits = self.steps.model(
            {"source_ids": source, "target_ids": target_inputs}, training=False
        )
        log_probs = ops.log_softmax(ops.cast(logits, "float32"), axis=-1)
        picked = ops.take_along_axis(log_probs, ops.convert_to_tensor(labels)[..., None], -1)
        return to_numpy(picked[..., 0]).astype(np.float64)

    def alignment_weights(self, source, target_inputs):
        parts = self.steps.parts
        _, weights = parts.logits_and_cross_attention(source, target_inputs)
        layer = to_numpy(weights[alignment_layer(parts.config.num_decoder_layers)])  # (B, N, T, S)
        return layer.mean(1)

    def parallel(self, count, beam_size):
        return [self] * count


class _CachedState:
    """The search loop's state on the compiled cached step; every row stays to the end."""

    drops_finished = False  # one compiled shape per batch

    def __init__(self, steps, tiled, length):
        self.steps = steps
        tiled = _padded(tiled, len(tiled), compiled_length(tiled.shape[1], steps.config.max_length))
        _, self.source_mask, self.cross_caches = steps.encode(ops.convert_to_tensor(tiled))
        self.caches = steps.empty_self_caches(len(tiled), length)

    def step(self, last, t):
        log_probs, self.caches = self.steps.step(
            ops.convert_to_tensor(last[:, None]),
            ops.convert_to_tensor(t, "int32"),
            self.caches,
            self.cross_caches,
            self.source_mask,
        )
        return to_numpy(log_probs)

    def reorder(self, rows):
        rows = ops.convert_to_tensor(rows)
        self.caches = [ops.take(cache, rows, axis=0) for cache in self.caches]


class _FullState:
    """The reference state: the whole decoder over the output so far, at every step."""

    drops_finished = False

    def __init__(self, steps, tiled):
        self.steps = steps
        self.encoded, self.source_mask, _ = steps.encode(ops.convert_to_tensor(tiled))
        self.inputs = np.zeros((len(tiled), 0), np.int32)

    def step(self, last, t):
        self.inputs = np.concatenate([self.inputs, last[:, None].astype(np.int32)], axis=1)
        # jax.jit compiles once per shape: grow the input in blocks of 8 there.
        # Positions after t are padding, which the causal mask keeps out of t.
        width = -(-(t + 1) // 8) * 8 if self.steps.backend == "jax" else t + 1
        padded = np.zeros((len(self.inputs), width), np.int32)
        padded[:, : t + 1] = self.inputs
        log_probs = self.steps.full(
            ops.convert_to_tensor(padded),
            self.encoded,
            self.source_mask,
            ops.convert_to_tensor(t, "int32"),
        )
        return to_numpy(log_probs)

    def reorder(self, rows):
        self.inputs = self.inputs[rows]
