"""Marian directories in the Hugging Face layout, built here for the import tests.

`marian_tokenizer_files` trains two small SentencePiece models on the toy
corpus and writes Marian's `vocab.json` (`</s>` 0, `<unk>` 1, `<pad>` last).
`numpy_checkpoint` writes random weights under transformers' MarianMT names
with safetensors alone (no PyTorch: the tier CI runs); `transformers_checkpoint`
builds a random `MarianMTModel` with transformers itself (the `pretrained` tier).
"""

from __future__ import annotations

import json
import os

import numpy as np

from benchmarks.marian_shape import layer_tensors, marian_vocabulary, train_spm

SOURCE_EXTRA = ["Ein großer Hund läuft über die Straße.", "Zwei Kinder spielen im Park."]
TARGET_EXTRA = ["A big dog runs across the street.", "Two children play in the park."]
# Variants of the issue: relu and swish (and gelu), shared and separate
# vocabularies, with and without final_logits_bias, scaled or unscaled embeddings.
VARIANTS = {
    "relu-shared-bias": dict(activation_function="relu", scale_embedding=True, bias=True),
    "swish-shared-nobias": dict(activation_function="swish", scale_embedding=False, bias=False),
    "gelu-separate-bias": dict(
        activation_function="gelu", scale_embedding=True, bias=True, separate=True
    ),
    # an output projection of its own, and a shallower decoder
    "relu-untied-3-1": dict(
        activation_function="relu",
        scale_embedding=True,
        bias=True,
        tie_word_embeddings=False,
        encoder_layers=3,
        decoder_layers=1,
    ),
}


def _texts():
    from keras_transformer.data.toy import generate_toy_corpus

    corpus = generate_toy_corpus(num_train=300, num_valid=5, num_test=5, seed=5)
    return (
        [s for s, _ in corpus.train] + SOURCE_EXTRA * 5,
        [t for _, t in corpus.train] + TARGET_EXTRA * 5,
    )


def marian_tokenizer_files(folder, separate=False, vocabulary_size=None):
    """Writes source.spm, target.spm, vocab.json (and target_vocab.json with
    `separate`); returns `(source_size, target_size, pad_id)`."""
    os.makedirs(folder, exist_ok=True)
    sources, targets = _texts()
    source, target = train_spm(sources, 90), train_spm(targets, 90)
    for name, data in (("source.spm", source), ("target.spm", target)):
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    if separate:
        vocabularies = [
            marian_vocabulary(source, pad_first=True),
            marian_vocabulary(target, pad_first=True),
        ]
    else:
        vocabularies = [marian_vocabulary(source, target)]
    if vocabulary_size:  # widened to a real model's size with pieces no text makes
        (vocabulary,) = vocabularies
        pad = vocabulary.pop("<pad>")
        assert pad == len(vocabulary)
        for i in range(vocabulary_size - len(vocabulary) - 1):
            vocabulary[f"\u2581x{i:05d}"] = len(vocabulary)
        vocabulary["<pad>"] = len(vocabulary)
    names = ["vocab.json", "target_vocab.json"]
    for name, vocabulary in zip(names, vocabularies, strict=False):
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump(vocabulary, f, ensure_ascii=False)
    return len(vocabularies[0]), len(vocabularies[-1]), vocabularies[-1]["<pad>"]


def marian_config(sizes, variant, d=64, layers=(2, 2), ffn=128, heads=4):
    source_size, target_size, pad = sizes
    options = dict(VARIANTS[variant])
    separate = options.pop("separate", False)
    options.pop("bias")
    layers = (options.pop("encoder_layers", layers[0]), options.pop("decoder_layers", layers[1]))
    return dict(
        model_type="marian",
        architectures=["MarianMTModel"],
        vocab_size=source_size,
        decoder_vocab_size=target_size,
        share_encoder_decoder_embeddings=not separate,
        d_model=d,
        encoder_layers=layers[0],
        decoder_layers=layers[1],
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn,
        max_position_embeddings=128,
        pad_token_id=pad,
        eos_token_id=0,
        decoder_start_token_id=pad,
        forced_eos_token_id=0,
        dropout=0.1,
        attention_dropout=0.0,
        **options,
    )


def numpy_checkpoint(folder, variant="relu-shared-bias", seed=0):
    """A random MarianMT directory written with numpy and safetensors; returns its config."""
    from safetensors.numpy import save_file

    separate = VARIANTS[variant].get("separate", False)
    sizes = marian_tokenizer_files(folder, separate)
    source_size, target_size, _ = sizes
    config = marian_config(sizes, variant)
    rng = np.random.default_rng(seed)
    d = config["d_model"]

    def normal(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    tensors = layer_tensors(
        config,
        normal,
        lambda n: normal(n, scale=0.05),
        lambda n: 1 + normal(n, scale=0.1),
        lambda n: normal(n, scale=0.1),
    )
    if separate:
        tensors["model.encoder.embed_tokens.weight"] = normal(source_size, d)
        tensors["model.decoder.embed_tokens.weight"] = normal(target_size, d)
    else:
        tensors["model.shared.weight"] = normal(source_size, d)
    if not config.get("tie_word_embeddings", True):
        tensors["lm_head.weight"] = normal(target_size, d)
        if not separate:  # as transformers saves it: the shared module and both copies
            tensors["model.encoder.embed_tokens.weight"] = tensors["model.shared.weight"]
            tensors["model.decoder.embed_tokens.weight"] = normal(target_size, d)
    bias = (
        normal(1, target_size, scale=1.0)
        if VARIANTS[variant]["bias"]
        else np.zeros((1, target_size), np.float32)
    )
    tensors["final_logits_bias"] = bias
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return config


def transformers_checkpoint(
    folder, variant="relu-shared-bias", seed=0, vocabulary_size=None, **shape
):
    """A random `MarianMTModel` saved by transformers (needs torch); returns the model."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    separate = VARIANTS[variant].get("separate", False)
    sizes = marian_tokenizer_files(folder, separate, vocabulary_size)
    config = marian_config(sizes, variant, **shape)
    config.pop("model_type")
    config.pop("architectures")
    torch.manual_seed(seed)
    model = MarianMTModel(MarianConfig(**config)).eval()
    # transformers' initialization (std 0.02) gives near-uniform outputs whose
    # near-ties float32 round-off decides; wider weights give clear choices.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "layer_norm" in name:
                parameter.copy_((name.endswith("weight")) + 0.1 * torch.randn_like(parameter))
            elif "embed_positions" not in name:
                parameter.normal_(0.0, 0.05 if name.endswith("bias") else 0.2)
        # The pad row stays zero, as in every converted OPUS-MT model (Marian
        # starts decoding from a zero embedding; CTranslate2 assumes it).
        for embedding in (model.model.encoder.embed_tokens, model.model.decoder.embed_tokens):
            embedding.weight[config["pad_token_id"]] = 0.0
    if VARIANTS[variant]["bias"]:
        model.final_logits_bias.copy_(torch.randn_like(model.final_logits_bias))
    model.save_pretrained(folder)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"separate_vocabs": separate, "tokenizer_class": "MarianTokenizer"}, f)
    return model


def native_release(folder, activation="swish", seed=0, d=64, layers=(2, 2), ffn=128, heads=4):
    """A random Marian release folder (decoder.yml, model.npz with its model.yml,
    vocab.yml, source.spm, target.spm), written with numpy as Marian names its tensors."""
    import yaml

    source_size, _, _ = marian_tokenizer_files(folder)
    with open(os.path.join(folder, "vocab.json"), encoding="utf-8") as f:
        vocabulary = json.load(f)
    os.remove(os.path.join(folder, "vocab.json"))
    vocabulary.pop("<pad>")  # Marian's own vocabulary has none
    with open(os.path.join(folder, "opus.vocab.yml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(vocabulary, f, allow_unicode=True, sort_keys=False, width=1000)
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    tensors = {"Wemb": normal(len(vocabulary), d)}
    tensors["decoder_ff_logit_out_b"] = normal(1, len(vocabulary), scale=1.0)
    for side, depth in (("encoder", layers[0]), ("decoder", layers[1])):
        for i in range(1, depth + 1):
            p = f"{side}_l{i}"
            for block in ["self"] + (["context"] if side == "decoder" else []):
                for x in "qkvo":
                    tensors[f"{p}_{block}_W{x}"] = normal(d, d)
                    tensors[f"{p}_{block}_b{x}"] = normal(1, d, scale=0.05)
                tensors[f"{p}_{block}_Wo_ln_scale"] = 1 + normal(1, d, scale=0.1)
                tensors[f"{p}_{block}_Wo_ln_bias"] = normal(1, d, scale=0.1)
            tensors[f"{p}_ffn_W1"], tensors[f"{p}_ffn_b1"] = normal(d, ffn), normal(1, ffn)
            tensors[f"{p}_ffn_W2"], tensors[f"{p}_ffn_b2"] = normal(ffn, d), normal(1, d)
            tensors[f"{p}_ffn_ffn_ln_scale"] = 1 + normal(1, d, scale=0.1)
            tensors[f"{p}_ffn_ffn_ln_bias"] = normal(1, d, scale=0.1)
    options = {
        "type": "transformer",
        "dim-emb": d,
        "enc-depth": layers[0],
        "dec-depth": layers[1],
        "transformer-heads": heads,
        "transformer-dim-ffn": ffn,
        "transformer-ffn-depth": 2,
        "transformer-ffn-activation": activation,
        "transformer-preprocess": "",
        "transformer-postprocess": "dan",
        "transformer-postprocess-emb": "d",
        "transformer-decoder-autoreg": "self-attention",
        "transformer-no-projection": False,
        "transformer-guided-alignment-layer": "last",
        "tied-embeddings-all": True,
    }
    text = yaml.safe_dump(options).encode() + b"\0"
    tensors["special:model.yml"] = np.frombuffer(text, np.int8)
    np.savez(os.path.join(folder, "opus.model1.npz"), **tensors)
    with open(os.path.join(folder, "decoder.yml"), "w") as f:
        yaml.safe_dump(
            {"models": ["opus.model1.npz"], "vocabs": ["opus.vocab.yml", "opus.vocab.yml"]}, f
        )
    return source_size
