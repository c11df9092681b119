"""Marian's own release format, as OPUS-MT and the Tatoeba models ship it.

A release folder holds `decoder.yml` (naming the `.npz` model and the YAML
vocabularies), the `.npz` (weights, and the training options as
`special:model.yml`), the vocabulary `*.vocab.yml` (piece: id) and the
SentencePiece models `source.spm` and `target.spm`.

`read_native` reads it into the form `marian.py` imports: transformers'
MarianMT tensor names and config fields, and a `MarianTokenizer`. It adds
what transformers' converter adds, a `<pad>` piece after the vocabulary with
a zero embedding: Marian starts decoding from a zero embedding, and
transformers (like us) from that pad row. Unlike that converter, the pad's
output bias is `PADDING_BIAS`, so that it takes no probability: the
log-probabilities are Marian's own. Options that change
the output and that this project does not build are refused by name.
"""

from __future__ import annotations

import os

import numpy as np

from keras_transformer.pretrained.marian import MarianImportError
from keras_transformer.pretrained.marian_weights import PADDING_BIAS

DECODER_YML = "decoder.yml"
# Marian's option -> the value this project builds (post-norm, self-attention
# decoder, tied embeddings, two-layer feed-forwards).
REQUIRED_OPTIONS = {
    "type": "transformer",
    "transformer-preprocess": "",
    "transformer-postprocess": "dan",
    "transformer-decoder-autoreg": "self-attention",
    "transformer-no-projection": False,
    "tied-embeddings-all": True,
}
# transformers' names for Marian's, per attention block.
ATTENTION = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj"}


def is_native(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, DECODER_YML))


def _yaml(path):
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise MarianImportError(f"Cannot read {path}: {error}") from error


def read_native(folder: str):
    """`(config, tensors, tokenizer)` of a Marian release folder, in transformers' form."""
    from keras_transformer.data.marian_tokenizer import MarianTokenizer

    decoder = _yaml(os.path.join(folder, DECODER_YML))
    try:
        model_path = os.path.join(folder, decoder["models"][0])
        vocabularies = [os.path.join(folder, v) for v in decoder["vocabs"]]
    except (KeyError, IndexError, TypeError) as error:
        raise MarianImportError(
            f"{os.path.join(folder, DECODER_YML)} names no model and vocabularies ({error})."
        ) from error
    if len(set(vocabularies)) != 1:
        raise MarianImportError(
            f"{DECODER_YML} names separate vocabularies ({', '.join(vocabularies)}); only "
            "Marian models with one shared vocabulary import from the native format."
        )
    if not os.path.isfile(model_path):
        raise FileNotFoundError(f"Marian model file missing: {model_path}")
    try:
        npz = dict(np.load(model_path))
    except (OSError, ValueError, EOFError) as error:
        raise MarianImportError(f"{model_path} is not a whole .npz file: {error}") from error
    if "special:model.yml" not in npz:
        raise MarianImportError(f"{model_path} has no special:model.yml: not a Marian model.")
    import yaml

    options = yaml.safe_load(npz.pop("special:model.yml")[:-1].tobytes())
    vocabulary = _yaml(vocabularies[0])
    if not isinstance(vocabulary, dict):
        raise MarianImportError(f"{vocabularies[0]} is not a Marian vocabulary (piece: id).")
    vocabulary = {str(piece): int(i) for piece, i in vocabulary.items()}
    size = len(vocabulary)
    vocabulary["<pad>"] = size  # as transformers' converter adds it
    config = native_config(options, size + 1, vocabulary)
    tensors = native_tensors(npz, options)

    try:
        tokenizer = MarianTokenizer.read(folder, vocabulary)
    except ValueError as error:
        raise MarianImportError(str(error)) from error
    return config, tensors, tokenizer


def native_config(options: dict, vocabulary_size: int, vocabulary: dict) -> dict:
    """transformers' MarianConfig fields for Marian's training `options`."""

    def refuse(name, why):
        raise MarianImportError(f"model.yml: {name}={options.get(name)!r} {why}.")

    for name, value in REQUIRED_OPTIONS.items():
        if options.get(name, value) != value:
            refuse(name, f"is not supported (this project builds {value!r})")
    if "n" in str(options.get("transformer-postprocess-emb", "d")):
        refuse("transformer-postprocess-emb", "normalizes the embeddings, which is not supported")
    if options.get("transformer-tied-layers"):
        refuse("transformer-tied-layers", "is not supported")
    for name in ("transformer-ffn-depth", "transformer-decoder-ffn-depth"):
        if options.get(name, 2) not in (0, 2):
            refuse(name, "is not supported (two-layer feed-forwards only)")
    activation = options.get("transformer-ffn-activation", "swish")
    if activation not in ("swish", "relu"):
        refuse(
            "transformer-ffn-activation",
            "is not supported (swish and relu; Marian's gelu is its sigmoid approximation)",
        )
    ffn = options.get("transformer-dim-ffn")
    if options.get("transformer-decoder-dim-ffn", 0) not in (0, ffn):
        refuse("transformer-decoder-dim-ffn", f"differs from transformer-dim-ffn={ffn}")
    if "</s>" not in vocabulary or "<unk>" not in vocabulary:
        raise MarianImportError("The Marian vocabulary has no </s> or <unk> piece.")
    pad = vocabulary_size - 1
    return {
        "model_type": "marian",
        "d_model": options.get("dim-emb"),
        "encoder_layers": options.get("enc-depth"),
        "decoder_layers": options.get("dec-depth"),
        "encoder_attention_heads": options.get("transformer-heads"),
        "decoder_attention_heads": options.get("transformer-heads"),
        "encoder_ffn_dim": ffn,
        "decoder_ffn_dim": ffn,
        "activation_function": activation,
        "vocab_size": vocabulary_size,
        "decoder_vocab_size": vocabulary_size,
        "share_encoder_decoder_embeddings": True,
        "tie_word_embeddings": True,
        "scale_embedding": True,  # Marian always scales by sqrt(d)
        "max_position_embeddings": 512,
        "pad_token_id": pad,
        "decoder_start_token_id": pad,
        "eos_token_id": vocabulary["</s>"],
        "dropout": float(options.get("transformer-dropout", 0.1) or 0.0),
        "attention_dropout": float(options.get("transformer-dropout-attention", 0.0) or 0.0),
    }


def native_tensors(npz: dict, options: dict) -> dict[str, np.ndarray]:
    """Marian's tensors under transformers' names, the pad row added; an unknown
    tensor is refused (it would be dropped silently)."""
    tensors, used = {}, set()

    def take(name):
        if name not in npz:
            raise MarianImportError(f"The Marian model has no tensor {name}.")
        used.add(name)
        return np.asarray(npz[name], np.float32)

    def linear(marian, theirs):
        weight, bias = marian
        tensors[f"{theirs}.weight"] = take(weight).T
        tensors[f"{theirs}.bias"] = take(bias).reshape(-1)

    def norm(marian, theirs):
        tensors[f"{theirs}.weight"] = take(f"{marian}_ln_scale").reshape(-1)
        tensors[f"{theirs}.bias"] = take(f"{marian}_ln_bias").reshape(-1)

    def attention(marian, theirs):
        for short, name in ATTENTION.items():
            linear((f"{marian}_W{short}", f"{marian}_b{short}"), f"{theirs}.{name}")

    for side, depth in (
        ("encoder", options.get("enc-depth")),
        ("decoder", options.get("dec-depth")),
    ):
        for i in range(int(depth or 0)):
            ours, theirs = f"{side}_l{i + 1}", f"model.{side}.layers.{i}"
            attention(f"{ours}_self", f"{theirs}.self_attn")
            norm(f"{ours}_self_Wo", f"{theirs}.self_attn_layer_norm")
            if side == "decoder":
                attention(f"{ours}_context", f"{theirs}.encoder_attn")
                norm(f"{ours}_context_Wo", f"{theirs}.encoder_attn_layer_norm")
            linear((f"{ours}_ffn_W1", f"{ours}_ffn_b1"), f"{theirs}.fc1")
            linear((f"{ours}_ffn_W2", f"{ours}_ffn_b2"), f"{theirs}.fc2")
            norm(f"{ours}_ffn_ffn", f"{theirs}.final_layer_norm")
    embeddings = take("Wemb")
    tensors["model.shared.weight"] = np.concatenate([embeddings, np.zeros_like(embeddings[:1])])
    size = embeddings.shape[0]
    bias = (
        take("decoder_ff_logit_out_b").reshape(-1)
        if "decoder_ff_logit_out_b" in npz
        else np.zeros(size, np.float32)
    )
    # Marian's vocabulary has no pad: its bias keeps it out of the softmax, so the
    # log-probabilities are Marian's (transformers' converter leaves it at 0).
    tensors["final_logits_bias"] = np.concatenate([bias, [PADDING_BIAS]]).astype(np.float32)[None]
    unused = sorted(set(npz) - used)
    if unused:
        raise MarianImportError(
            f"The Marian model holds {len(unused)} tensor(s) this project has no place for, "
            f"such as {unused[0]}: its options describe a model this importer does not build."
        )
    return tensors
