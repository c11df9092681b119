"""A vocabulary shortlist counted from a run's training text (`keras-transformer export --shortlist-data`)."""

from __future__ import annotations

import itertools
import os

from keras_transformer_runtime.shortlist import build_shortlist

# Lines encoded per call of the tokenizer.
ENCODE_LINES = 10_000


def shortlist_from_files(tokenizer, vocabulary_size, source_path, target_path, per_piece, frequent):
    """The `Shortlist` of the parallel text files `source_path` and `target_path`
    (plain or .gz, one sentence per line), encoded with `tokenizer`.

    Raises `DataError` (a ValueError) where a file is missing, unreadable as
    UTF-8 beyond `LineReader`'s tolerance, or the two differ in length.
    """
    from keras_transformer.data.pipeline import DataError
    from keras_transformer.data.prepare import LineReader

    sources, targets = LineReader(os.fspath(source_path)), LineReader(os.fspath(target_path))
    encode_target = getattr(tokenizer, "encode_target", tokenizer.encode)

    def encoded_pairs():
        lines = itertools.zip_longest(sources, targets)
        while chunk := list(itertools.islice(lines, ENCODE_LINES)):
            if any(source is None or target is None for source, target in chunk):
                raise DataError(
                    f"{source_path} and {target_path} are not parallel: "
                    f"{sources.count} lines against {targets.count} "
                    "(counted up to where the shorter ended)."
                )
            yield from zip(
                [tokenizer.encode(source) for source, _ in chunk],
                [encode_target(target) for _, target in chunk],
                strict=True,
            )

    shortlist = build_shortlist(encoded_pairs(), vocabulary_size, per_piece, frequent)
    sources.check()
    targets.check()
    if sources.count == 0:
        raise DataError(f"{source_path} holds no lines: a shortlist needs training pairs.")
    return shortlist
