"""Sources and output limits of a batch: what every decoder and search takes the same way.

Padding source id lists into arrays, the per-sentence output limits (with
room for target prefixes), the teacher-forced inputs of forced scoring, and
the argument checks shared by the searches. Needs numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from keras_transformer_runtime.specials import BOS_ID, EOS_ID, PAD_ID

EXTRA_OUTPUT_TOKENS = 50  # default maximum output length = source length + 50


def check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer. Received: {name}={value!r}")


def check_beam_arguments(beam_size, length_penalty):
    check_positive_int("beam_size", beam_size)
    if (
        isinstance(length_penalty, bool)
        or not isinstance(length_penalty, (int, float))
        or length_penalty < 0
    ):
        raise ValueError(
            f"length_penalty must be a non-negative number. Received: {length_penalty!r}"
        )


def source_rows(source_ids):
    """The sources as int arrays without padding, from a padded 2-D int array or a
    list of token-id lists; anything else is refused by name."""
    if isinstance(source_ids, np.ndarray):
        if source_ids.ndim != 2:
            raise ValueError(
                "source_ids must have shape (batch_size, source_len). "
                f"Received shape {source_ids.shape}"
            )
        if not np.issubdtype(source_ids.dtype, np.integer):
            raise ValueError(
                f"source_ids must hold integer token ids. Received dtype {source_ids.dtype}"
            )
        return [row[row != PAD_ID] for row in source_ids]
    if not isinstance(source_ids, Sequence) or isinstance(source_ids, (str, bytes)):
        raise ValueError("source_ids must be a 2-D int array or a list of lists of token ids.")
    rows = [np.asarray(list(row), np.int64) for row in source_ids]
    for row in rows:
        if row.size and not np.issubdtype(row.dtype, np.integer):
            raise ValueError("source_ids must hold integer token ids.")
    return rows


def source_array(source_ids, model_max_length, multiple=8):
    """Pads token-id lists (or checks an array) into an int32 `(batch, width)` array.

    The width is a multiple of `multiple`: 8 (the default) so that a new
    source length rarely means a new compiled shape for a compiled decoder;
    1 for a runtime that takes any shape at no cost, so that no padding
    column is computed. Returns `(array, lengths)`. Nothing is truncated: a
    source longer than `model_max_length` (the positions the model trained
    on) is taken whole, its later positions computed rather than read from
    the table.
    """
    rows = source_rows(source_ids)
    lengths = np.array([len(row) for row in rows], np.int64)
    longest = int(lengths.max(initial=0))
    width = max(multiple, -(-longest // multiple) * multiple)
    if 0 < longest <= model_max_length:
        width = min(width, model_max_length)
    array = np.zeros((len(rows), max(width, 1)), np.int32)
    for i, row in enumerate(rows):
        array[i, : len(row)] = row
    return array, lengths


def output_limits(lengths, max_length, model_max_length):
    """Per-sentence maximum number of generated tokens (EOS included); 0 for empty sources.

    Given `max_length`, that for every sentence. Otherwise the source length
    plus `EXTRA_OUTPUT_TOKENS`, at most `model_max_length` or twice the
    source length, whichever is larger: a source longer than the model's
    training positions may get an output as long.
    """
    if max_length is not None:
        check_positive_int("max_length", max_length)
        limits = np.full(len(lengths), max_length, np.int64)
    else:
        lengths = np.asarray(lengths, np.int64)
        cap = np.maximum(model_max_length, 2 * lengths)
        limits = np.minimum(lengths + EXTRA_OUTPUT_TOKENS, cap)
    return np.where(np.asarray(lengths) == 0, 0, limits)


def prefixed_limits(limits, prefixes, max_length):
    """The output limits with room for each prefix: without `max_length`, a
    sentence's default limit grows to its prefix plus one token; with it, a
    prefix that leaves no room is refused by `SentenceSearch`."""
    limits = np.array(limits, np.int64)
    if max_length is None and prefixes is not None:
        for i, prefix in enumerate(prefixes):
            if limits[i] and prefix:
                limits[i] = max(limits[i], len(prefix) + 1)
    return limits


def teacher_inputs(targets):
    """`(BOS + target)` rows padded into an int32 array: the teacher-forced decoder input."""
    width = max(len(t) for t in targets) + 1
    array = np.zeros((len(targets), width), np.int32)
    for i, target in enumerate(targets):
        array[i, : len(target) + 1] = [BOS_ID, *target]
    return array


def teacher_labels(targets):
    """`(target + EOS)` rows padded into an int32 array: what each position of
    `teacher_inputs(targets)` predicts."""
    width = max(len(t) for t in targets) + 1
    array = np.zeros((len(targets), width), np.int32)
    for i, target in enumerate(targets):
        array[i, : len(target) + 1] = [*target, EOS_ID]
    return array
