"""Greedy and beam search, scoring and alignment for a model from `build_transformer`.

Each function is the runtime's one translation core
(`keras_transformer_runtime.translator.Translator`) over the Keras decoder
(`keras_transformer.keras_decoder.KerasDecoder`): the same search, options,
scoring and alignment as the ONNX Runtime translator, by the rules of
`keras_transformer_runtime.spec` (the tests check both against them).

Conventions: padding id 0, BOS 1, EOS 2. Returned token ids exclude BOS and
stop before EOS. A source longer than the model's `max_length` is taken
whole, its later positions computed rather than read from the table. An
empty source (no non-padding token) gives an empty output with score 0.
"""

from __future__ import annotations

import numpy as np
from keras import ops
from keras_transformer_runtime.sources import EXTRA_OUTPUT_TOKENS, source_array
from keras_transformer_runtime.spec import length_penalty_factor
from keras_transformer_runtime.specials import BOS_ID, EOS_ID, PAD_ID
from keras_transformer_runtime.translator import Translator

from keras_transformer.keras_decoder import KerasDecoder, to_numpy
from keras_transformer.model import transformer_parts

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
    "translator",
]


def translator(model, tokenizer=None, use_cache=True):
    """The translation core over `model`: `Translator(KerasDecoder(model), tokenizer)`."""
    return Translator(KerasDecoder(model, use_cache=use_cache), tokenizer)


def _ids(source_ids):
    return to_numpy(source_ids) if ops.is_tensor(source_ids) else source_ids


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
    return translator(model, use_cache=use_cache).greedy_search(
        _ids(source_ids), max_length=max_length, ignore_eos=ignore_eos
    )


def beam_search(
    model, source_ids, beam_size=4, length_penalty=0.6, max_length=None, ignore_eos=False
):
    """Beam search with the length penalty ((5 + len) / 6) ** length_penalty, batched.

    See `Translator.beam_search`; the arguments are `greedy_search`'s, and
    `beam_size` (4 in the paper) and `length_penalty` (alpha, 0.6 in the
    paper; 0 disables it).

    Returns:
        `(tokens, scores)`: the best hypothesis of each sentence as an int list
        (no BOS, cut before EOS), and its length-penalized score (float64).
    """
    return translator(model).beam_search(
        _ids(source_ids), beam_size, length_penalty, max_length, ignore_eos
    )


def search(model, source_ids, options=None, prefixes=None, indices=None, constraints=None):
    """The best hypotheses of each source under `options` (a `SearchOptions`):
    `Translator.search` (n-best, prefixes, sampling, constraints, alignments)."""
    return translator(model).search(_ids(source_ids), options, prefixes, indices, constraints)


def score(model, source_ids, target_ids):
    """Forced decoding: per sentence `(log_prob, token_scores)` of `target_ids[i]`
    (no BOS, no EOS) given `source_ids[i]`, EOS scored last; `(None, None)` for
    an empty source (`Translator.score_ids`)."""
    return translator(model).score_ids(_ids(source_ids), target_ids)


def align(model, source_ids, target_ids):
    """Per sentence, the source position each token of `target_ids[i]` attends to most
    (`Translator.align_ids`)."""
    return translator(model).align_ids(_ids(source_ids), target_ids)


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
    source, _ = source_array(_ids(source_ids), parts.config.max_length)
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
    log_probs = to_numpy(ops.log_softmax(logits, axis=-1)).astype(np.float64)
    picked = np.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    return (picked * (labels != PAD_ID)).sum(-1)
