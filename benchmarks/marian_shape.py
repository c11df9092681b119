"""A MarianMT directory of OPUS-MT's shape with fresh weights, for the pretrained benchmarks;
and the time and memory that importing and exporting one take.

    python -m benchmarks.marian_shape build OUT --src-train train.de.gz --tgt-train train.en.gz
    python -m benchmarks.marian_shape cost HF_DIR --out benchmarks/results/marian_cost.json

`cost` runs `keras-transformer import marian HF_DIR` and then `export
--format marian-hf` of that run, each in a process of its own, and reports
their wall time and peak resident memory (the process' `ru_maxrss`) beside
the checkpoint's size.

Trains a source and a target SentencePiece model on the texts (as Marian's
OPUS-MT recipe does, one per language), writes Marian's `vocab.json` (both
models' pieces, `</s>` 0, `<unk>` 1, `<pad>` last) and a Hugging Face
MarianMT `config.json` and `model.safetensors` of OPUS-MT's shape (d512, 6+6
layers, FFN 2048, 8 heads, swish, scaled embeddings, tied, an output bias)
with Glorot-uniform weights and a zero pad row. `keras-transformer import
marian OUT` then trains it (`train --init-from`) like any imported model;
benchmarks/README.md has the whole protocol. No PyTorch is needed.
"""

from __future__ import annotations

import argparse
import io
import json
import os

import numpy as np

from benchmarks import harness


def train_spm(texts, size, seed=0):
    """A unigram SentencePiece model's bytes, as Marian's recipe trains one per language."""
    import sentencepiece as spm

    spm.set_random_generator_seed(seed)
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=buffer,
        vocab_size=size,
        hard_vocab_limit=False,
        character_coverage=1.0,
        minloglevel=2,
    )
    return buffer.getvalue()


def marian_vocabulary(*models, pad_first=False):
    """Marian's vocab.json of the models' pieces: `</s>` 0, `<unk>` 1, `<pad>` last
    (or 2 with `pad_first`)."""
    import sentencepiece as spm

    vocabulary = {"</s>": 0, "<unk>": 1}
    if pad_first:
        vocabulary["<pad>"] = 2
    for model in models:
        processor = spm.SentencePieceProcessor(model_proto=model)
        for i in range(processor.get_piece_size()):
            if not (processor.is_control(i) or processor.is_unknown(i)):
                vocabulary.setdefault(processor.id_to_piece(i), len(vocabulary))
    vocabulary.setdefault("<pad>", len(vocabulary))
    return vocabulary


def layer_tensors(config, weight, bias, norm_weight, norm_bias):
    """The encoder and decoder layers' MarianMT tensors under transformers' names:
    `weight(out, in)` and `bias(out)` of each linear, `norm_weight(d)` and
    `norm_bias(d)` of each LayerNorm, called in that order, layer by layer."""
    d, ffn = config["d_model"], config["encoder_ffn_dim"]
    tensors = {}

    def linear(name, out, inp):
        tensors[f"{name}.weight"] = weight(out, inp)
        tensors[f"{name}.bias"] = bias(out)

    def norm(name):
        tensors[f"{name}.weight"] = norm_weight(d)
        tensors[f"{name}.bias"] = norm_bias(d)

    for side in ("encoder", "decoder"):
        for i in range(config[f"{side}_layers"]):
            p = f"model.{side}.layers.{i}"
            for block in ["self_attn"] + (["encoder_attn"] if side == "decoder" else []):
                for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                    linear(f"{p}.{block}.{proj}", d, d)
                norm(f"{p}.{block}_layer_norm")
            linear(f"{p}.fc1", ffn, d)
            linear(f"{p}.fc2", d, ffn)
            norm(f"{p}.final_layer_norm")
    return tensors


def weights(config, seed=0):
    """Glorot-uniform MarianMT tensors under transformers' names (zero biases, unit norms)."""
    rng = np.random.default_rng(seed)
    d, size = config["d_model"], config["vocab_size"]

    def glorot(out, inp):
        limit = np.sqrt(6.0 / (out + inp))
        return rng.uniform(-limit, limit, (out, inp)).astype(np.float32)

    def zeros(n):
        return np.zeros(n, np.float32)

    tensors = layer_tensors(config, glorot, zeros, lambda n: np.ones(n, np.float32), zeros)
    shared = (rng.standard_normal((size, d)) * d**-0.5).astype(np.float32)
    shared[config["pad_token_id"]] = 0.0
    tensors["model.shared.weight"] = shared
    tensors["final_logits_bias"] = np.zeros((1, size), np.float32)
    return tensors


def build(out, sources, targets, vocab_size, d, layers, ffn, heads, activation, seed=0, total=None):
    from safetensors.numpy import save_file

    os.makedirs(out, exist_ok=True)
    source, target = train_spm(sources, vocab_size, seed), train_spm(targets, vocab_size, seed)
    vocabulary = marian_vocabulary(source, target)
    if total:  # widened to a real model's size by pieces no text makes (the cost benchmark)
        pad = vocabulary.pop("<pad>")
        for i in range(total - pad - 1):
            vocabulary[f"\u2581x{i:05d}"] = len(vocabulary)
        vocabulary["<pad>"] = len(vocabulary)
    for name, data in (("source.spm", source), ("target.spm", target)):
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    with open(os.path.join(out, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocabulary, f, ensure_ascii=False)
    pad = vocabulary["<pad>"]
    config = {
        "model_type": "marian",
        "architectures": ["MarianMTModel"],
        "d_model": d,
        "encoder_layers": layers[0],
        "decoder_layers": layers[1],
        "encoder_attention_heads": heads,
        "decoder_attention_heads": heads,
        "encoder_ffn_dim": ffn,
        "decoder_ffn_dim": ffn,
        "activation_function": activation,
        "vocab_size": len(vocabulary),
        "decoder_vocab_size": len(vocabulary),
        "share_encoder_decoder_embeddings": True,
        "tie_word_embeddings": True,
        "scale_embedding": True,
        "max_position_embeddings": 512,
        "pad_token_id": pad,
        "decoder_start_token_id": pad,
        "eos_token_id": 0,
        "forced_eos_token_id": 0,
        "bad_words_ids": [[pad]],
        "dropout": 0.1,
        "attention_dropout": 0.0,
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(weights(config, seed), os.path.join(out, "model.safetensors"), {"format": "pt"})
    return config


def cost(args):
    """Wall time and peak memory of the import and of the export back, each alone."""
    import subprocess
    import sys
    import tempfile
    import time

    steps = {}
    with tempfile.TemporaryDirectory() as work:
        run, back = os.path.join(work, "run"), os.path.join(work, "back")
        commands = {
            # Python, TensorFlow and Keras loaded, nothing done: what every step starts from.
            "baseline": None,
            "import": ["import", "marian", args.hf_dir, "--out", run],
            "export_marian_hf": ["export", run, "--format", "marian-hf", "--out", back],
        }
        for name, command in commands.items():
            # A fresh child per step: RUSAGE_CHILDREN's maximum is then this step's.
            code = (
                "import resource, sys, time; from keras_transformer import cli; "
                "import keras_transformer.pretrained.marian_export; "
                "start = time.perf_counter(); sys.argv[1:] and cli.main(sys.argv[1:]); "
                "print(time.perf_counter() - start, "
                "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
            )
            start = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-c", code, *(command or [])],
                capture_output=True,
                text=True,
                check=True,
            )
            inside, peak_kib = done.stdout.strip().splitlines()[-1].split()
            steps[name] = {
                "seconds_with_start": time.perf_counter() - start,
                "seconds_of_the_work": float(inside),
                "peak_rss_mib": int(peak_kib) / 1024,
            }
    checkpoint = os.path.getsize(os.path.join(args.hf_dir, "model.safetensors")) / 2**20
    base = steps["baseline"]["peak_rss_mib"]
    for entry in steps.values():
        entry["peak_rss_over_checkpoint"] = entry["peak_rss_mib"] / checkpoint
        entry["added_rss_over_checkpoint"] = (entry["peak_rss_mib"] - base) / checkpoint
    report = harness.write_report("marian_shape", args, checkpoint_mib=checkpoint, steps=steps)
    print(json.dumps({k: report[k] for k in ("checkpoint_mib", "steps")}, indent=2))


def main(argv=None):
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["cost"]:
        parser = argparse.ArgumentParser(description="import and export cost")
        parser.add_argument("hf_dir")
        parser.add_argument("--out", default="benchmarks/results/marian_cost.json")
        args = parser.parse_args(argv[1:])
        args.argv = argv
        return cost(args)
    if argv[:1] == ["build"]:
        argv = argv[1:]
    from keras_transformer.data.pipeline import read_lines

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="the MarianMT directory to write")
    parser.add_argument("--src-train", required=True)
    parser.add_argument("--tgt-train", required=True)
    parser.add_argument("--vocab-size", type=int, default=8000, help="pieces per language")
    parser.add_argument("--hidden-dim", type=int, default=512)
    parser.add_argument("--layers", type=int, nargs=2, default=(6, 6), metavar=("ENC", "DEC"))
    parser.add_argument("--intermediate-dim", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--activation", default="swish", choices=["swish", "relu", "gelu"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--total-vocabulary",
        type=int,
        help="widen vocab.json to this many pieces (opus-mt-de-en has 58,101), for the cost",
    )
    args = parser.parse_args(argv)
    config = build(
        args.out,
        read_lines(args.src_train),
        read_lines(args.tgt_train),
        args.vocab_size,
        args.hidden_dim,
        args.layers,
        args.intermediate_dim,
        args.heads,
        args.activation,
        args.seed,
        args.total_vocabulary,
    )
    print(
        f"Wrote {args.out}: d{config['d_model']}, {args.layers[0]}+{args.layers[1]} layers, "
        f"{config['vocab_size']} pieces"
    )


if __name__ == "__main__":
    main()
