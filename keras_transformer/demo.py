"""The built-in demo: train the tiny preset on the toy corpus and report exact match."""

from __future__ import annotations

import os
import time

import keras
import numpy as np

from keras_transformer.config import TransformerConfig
from keras_transformer.data.toy import WordVocabulary, encode_pairs, generate_toy_corpus
from keras_transformer.decoding import greedy_search
from keras_transformer.io_utils import atomic_save_model, atomic_write_json, atomic_write_text
from keras_transformer.losses import LabelSmoothedCrossEntropy, MaskedAccuracy
from keras_transformer.model import build_transformer
from keras_transformer.schedules import transformer_optimizer


def run_demo(
    out_dir: str = "runs/demo",
    preset: str = "tiny",
    epochs: int = 10,
    num_train: int = 20000,
    num_test: int = 500,
    max_words: int = 8,
    batch_size: int = 64,
    warmup_steps: int = 1000,
    label_smoothing: float = 0.1,
    seed: int = 0,
    num_examples: int = 5,
    verbose: int = 1,
    jit_compile=True,
    **config_overrides,
) -> dict:
    """Trains `preset` on the toy corpus with `model.fit`, decodes the test split greedily.

    Writes `model.keras` and `metrics.json` into `out_dir` and returns the metrics.
    """
    keras.utils.set_random_seed(seed)
    corpus = generate_toy_corpus(
        num_train=num_train, num_valid=num_test, num_test=num_test, max_words=max_words, seed=seed
    )
    vocabulary = WordVocabulary.from_corpus(corpus)
    config = TransformerConfig.from_preset(preset, **config_overrides)
    if config.vocabulary_size < len(vocabulary):
        raise ValueError(
            f"The toy corpus has {len(vocabulary)} tokens but the config's "
            f"vocabulary_size is {config.vocabulary_size}."
        )
    x_train, y_train = encode_pairs(corpus.train, vocabulary, config.max_length)
    x_valid, y_valid = encode_pairs(corpus.valid, vocabulary, config.max_length)

    model = build_transformer(config)
    model.compile(
        optimizer=transformer_optimizer(config.hidden_dim, warmup_steps=warmup_steps),
        loss=LabelSmoothedCrossEntropy(label_smoothing),
        metrics=[MaskedAccuracy()],
        jit_compile=jit_compile,
    )
    model.optimizer.build(model.trainable_variables)  # not inside the first trace: one trace
    started = time.perf_counter()
    history = model.fit(
        x_train,
        y_train,
        validation_data=(x_valid, y_valid),
        batch_size=batch_size,
        epochs=epochs,
        shuffle=True,
        verbose=verbose,
    )
    train_seconds = time.perf_counter() - started

    sources = [s for s, _ in corpus.test]
    references = [t for _, t in corpus.test]
    source_ids = encode_pairs(corpus.test, vocabulary, config.max_length)[0]["source_ids"]
    started = time.perf_counter()
    outputs, _ = greedy_search(model, source_ids)
    decode_seconds = time.perf_counter() - started
    hypotheses = [vocabulary.decode(ids) for ids in outputs]
    exact = float(np.mean([h == r for h, r in zip(hypotheses, references, strict=True)]))

    if verbose:
        print()
        for source, reference, hypothesis in list(
            zip(sources, references, hypotheses, strict=True)
        )[:num_examples]:
            mark = "ok " if hypothesis == reference else "BAD"
            print(
                f"[{mark}] source:    {source}\n      reference: {reference}\n      output:    {hypothesis}"
            )
        print(f"\nExact match on {len(references)} held-out test sentences: {exact:.4f}")
        print(f"Training: {train_seconds:.1f} s; greedy decoding: {decode_seconds:.1f} s")

    metrics = {
        "exact_match": exact,
        "train_seconds": train_seconds,
        "decode_seconds": decode_seconds,
        "epochs": epochs,
        "num_train": num_train,
        "num_test": len(references),
        "final_train_loss": float(history.history["loss"][-1]),
        "final_valid_loss": float(history.history["val_loss"][-1]),
        "final_valid_accuracy": float(history.history["val_masked_accuracy"][-1]),
        "config": config.to_dict(),
        "backend": keras.backend.backend(),
    }
    os.makedirs(out_dir, exist_ok=True)
    atomic_save_model(model, os.path.join(out_dir, "model.keras"))
    vocabulary.save(os.path.join(out_dir, "vocab.txt"))
    atomic_write_text(os.path.join(out_dir, "config.json"), config.to_json() + "\n")
    atomic_write_json(os.path.join(out_dir, "metrics.json"), metrics)
    if verbose:
        print(f"Wrote model.keras, vocab.txt, config.json and metrics.json to {out_dir}")
    return metrics
