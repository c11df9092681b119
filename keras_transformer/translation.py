"""Translating text with a trained run directory: load the model and tokenizer, translate.

The text-level functions are the runtime's one translation core
(`keras_transformer_runtime.translator.Translator`) over the Keras decoder:
the same batching, options, prefixes, constraints and scoring as
`OnnxTranslator`.
"""

from __future__ import annotations

import os

from keras_transformer.decoding import translator
from keras_transformer.io_utils import load_keras_archive


def load_run(run_dir: str):
    """Loads `model.keras` and the run's tokenizer from `run_dir`.

    Returns `(model, tokenizer)`; the tokenizer has `encode(text) -> ids`,
    `decode(ids) -> text` and `eos_id`. The model is loaded uncompiled: its
    users decode or export, and compiling would rebuild an optimizer that a
    `mixed_float16` run saved with loss scaling (Keras then warns that it
    skips the optimizer's variables).
    """
    model_path = run_model_path(run_dir)
    tokenizer = load_tokenizer(run_dir)
    check_keras_archive(model_path)
    try:
        model = load_keras_archive(model_path, compile=False)
    except Exception as error:  # a truncated or foreign file
        raise ValueError(f"Cannot load {model_path}: {error}") from error
    return model, tokenizer


def run_model_path(run_dir: str) -> str:
    """`run_dir`'s `model.keras`; `FileNotFoundError` saying what is missing when either is."""
    model_path = os.path.join(run_dir, "model.keras")
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"Run directory not found: {run_dir}")
    if not os.path.isfile(model_path):
        raise FileNotFoundError(
            f"No model.keras in {run_dir}: train a model into it first "
            "(e.g. `keras-transformer demo --out DIR`)."
        )
    return model_path


def check_keras_archive(path: str) -> None:
    """Raises a `ValueError` that says what is wrong when `path` is not a whole `.keras` file.

    Keras reports a truncated or foreign file as "File not found"; this says
    whether the file is no zip archive at all, a damaged one, or one without
    a model's config and weights.
    """
    import zipfile

    size = os.path.getsize(path)
    if not zipfile.is_zipfile(path):
        raise ValueError(
            f"{path} is not a Keras model file ({size} bytes, not a .keras zip archive): "
            "it may be truncated or overwritten. Train or copy the model again."
        )
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        raise ValueError(f"{path} is a damaged .keras archive ({size} bytes): {error}") from error
    if damaged is not None:
        raise ValueError(f"{path} is a damaged .keras archive: {damaged} fails its checksum.")
    missing = [name for name in ("config.json", "model.weights.h5") if name not in names]
    if missing:
        raise ValueError(f"{path} is not a Keras model file: it has no {', '.join(missing)}.")


# A run's tokenizer files: SentencePiece's, or Marian's (`vocab.json` with its two
# SentencePiece models, and `target_vocab.json` for separate vocabularies).
TOKENIZER_FILES = ("spm.model", "vocab.json", "source.spm", "target.spm", "target_vocab.json")


def load_tokenizer(run_dir: str):
    """The run's tokenizer: `spm.model` (SentencePiece), Marian's `vocab.json` with
    `source.spm` and `target.spm` (an imported model), or `vocab.txt` (the toy
    demo's words)."""
    if os.path.isfile(os.path.join(run_dir, "vocab.json")):
        from keras_transformer.data.marian_tokenizer import MarianTokenizer

        return MarianTokenizer.load(run_dir)
    spm_path = os.path.join(run_dir, "spm.model")
    if os.path.isfile(spm_path):
        from keras_transformer.data.tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer.load(spm_path)
    vocab_path = os.path.join(run_dir, "vocab.txt")
    if os.path.isfile(vocab_path):
        from keras_transformer.data.toy import WordVocabulary

        return WordVocabulary.load(vocab_path)
    raise FileNotFoundError(
        f"No tokenizer in {run_dir}: expected spm.model, vocab.json (Marian) or vocab.txt."
    )


def translate_lines(
    model,
    tokenizer,
    lines,
    beam_size=4,
    batch_size=32,
    max_length=None,
    progress=False,
    warn=None,
    length_penalty=0.6,
    constraints=None,
):
    """Translates `lines` in order; `beam_size=1` (or `None`) is greedy search.

    `Translator.translate`: sentences sorted by length into batches and put
    back in order; empty lines give empty lines; a line longer than the
    model's `max_length` is translated whole and reported to `warn(message)`.
    `constraints`, one entry per line (a list of target phrases, or None or
    `[]` for none), makes every translation hold its phrases
    (docs/constraints.md).
    """
    return translator(model, tokenizer).translate(
        lines,
        beam_size=beam_size or 1,
        max_length=max_length,
        batch_size=batch_size,
        progress=progress,
        warn=warn,
        length_penalty=length_penalty,
        constraints=constraints,
    )


def translate_hypotheses(
    model,
    tokenizer,
    lines,
    options=None,
    prefixes=None,
    batch_size=32,
    progress=False,
    warn=None,
    constraints=None,
):
    """Translates `lines` under `options` (a `SearchOptions`): per line a list of
    dicts, best first, with `text`, `score`, `log_prob` (and `token_scores`,
    `alignment`); `Translator.translate_hypotheses`."""
    return translator(model, tokenizer).translate_hypotheses(
        lines, options, prefixes, batch_size, progress, warn, constraints
    )


def score_lines(model, tokenizer, sources, targets, batch_size=32, progress=False, warn=None):
    """Forced decoding of text pairs: per pair a dict of `log_prob` (summed, EOS
    included) and `token_scores` (None for an empty source); `Translator.score`."""
    return translator(model, tokenizer).score(sources, targets, batch_size, progress, warn)
