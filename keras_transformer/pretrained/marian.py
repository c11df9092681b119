"""Marian / OPUS-MT checkpoints in the Hugging Face layout: import into a run directory.

A Hugging Face MarianMT directory holds `config.json`, the weights
(`model.safetensors`, or `pytorch_model.bin` which needs PyTorch to read),
`source.spm`, `target.spm` and `vocab.json` (plus `target_vocab.json` for
separate vocabularies). `import_marian` turns one into an ordinary run
directory (`model.keras` beside the tokenizer files) that `translate`,
`evaluate`, `export` and `train --init-from` take as they take our own runs.

What a Marian model is, in this project's config (`marian_config`): post-norm
layers, sinusoids in Marian's concatenated layout, embeddings scaled by
sqrt(d) where `scale_embedding` says so, LayerNorm epsilon 1e-5, the
feed-forward activation of `activation_function`, `final_logits_bias` as an
output bias, and the vocabulary renumbered once
(`keras_transformer_runtime.marian_vocabulary`). A configuration outside
that is refused, naming the field: a model is never imported half right.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from keras_transformer.config import TransformerConfig

CONFIG = "config.json"
SAFETENSORS, TORCH_BIN = "model.safetensors", "pytorch_model.bin"
# transformers' activation names -> ours (silu is swish).
ACTIVATIONS = {"relu": "relu", "swish": "swish", "silu": "swish", "gelu": "gelu"}
# Fields that would change the output if set otherwise, with the value Marian has.
MARIAN_ONLY = {
    "normalize_before": False,
    "normalize_embedding": False,
    "add_final_layer_norm": False,
    "static_position_embeddings": True,
    "add_bias_logits": False,
    "scale_attention": None,
}
TORCH_LAYER_NORM_EPSILON = 1e-5


class MarianImportError(ValueError):
    """A Marian directory this importer cannot take; the message names what and why."""


def read_config(folder: str) -> dict:
    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} is not a Marian model directory: no {CONFIG}.")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise MarianImportError(f"{path} is not JSON: {error}") from error
    if not isinstance(config, dict):
        raise MarianImportError(f"{path} is not a JSON object.")
    return config


def marian_config(hf: dict, tokenizer) -> TransformerConfig:
    """Our `TransformerConfig` for the transformers `MarianConfig` dict `hf`.

    Raises:
        MarianImportError: a field this project does not build, or one that
            disagrees with the tokenizer, named.
    """

    def field(name, default=None):
        return hf.get(name, default)

    def refuse(name, why):
        raise MarianImportError(f"config.json: {name}={field(name)!r} {why}.")

    if field("model_type") != "marian":
        refuse("model_type", "is not supported: only 'marian' checkpoints import")
    for name, marian_value in MARIAN_ONLY.items():
        if name in hf and field(name) not in (marian_value, None):
            refuse(name, f"is not Marian's ({marian_value!r}) and is not supported")
    activation = ACTIVATIONS.get(field("activation_function", "gelu"))
    if activation is None:
        refuse("activation_function", f"is not supported (supported: {', '.join(ACTIVATIONS)})")
    for encoder, decoder in (
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    ):
        if field(encoder) != field(decoder):
            refuse(decoder, f"differs from {encoder}={field(encoder)!r}, which is not supported")
    pad, start, eos = field("pad_token_id"), field("decoder_start_token_id"), field("eos_token_id")
    source_vocabulary = tokenizer.source.vocabulary
    target_vocabulary = tokenizer.target.vocabulary
    if start not in (None, pad):
        refuse("decoder_start_token_id", f"is not pad_token_id={pad!r}: not a Marian model")
    for name, value, piece in (("pad_token_id", pad, "<pad>"), ("eos_token_id", eos, "</s>")):
        if value is not None and target_vocabulary.get(piece) != value:
            refuse(
                name, f"is not the id of {piece} in the vocabulary ({target_vocabulary.get(piece)})"
            )
    shared = bool(field("share_encoder_decoder_embeddings", True))
    vocabulary_size = field("vocab_size")
    target_size = vocabulary_size if shared else field("decoder_vocab_size") or vocabulary_size
    if vocabulary_size != len(source_vocabulary):
        refuse(
            "vocab_size", f"disagrees with vocab.json, which has {len(source_vocabulary)} pieces"
        )
    if target_size != len(target_vocabulary):
        refuse(
            "decoder_vocab_size" if not shared else "vocab_size",
            f"disagrees with the target vocabulary, which has {len(target_vocabulary)} pieces",
        )
    if shared and tokenizer.separate_vocabularies:
        refuse(
            "share_encoder_decoder_embeddings", "is true but the tokenizer has target_vocab.json"
        )
    d = field("d_model")
    tie_output = bool(field("tie_word_embeddings", True))
    try:
        return TransformerConfig(
            vocabulary_size=len(tokenizer),
            source_vocabulary_size=tokenizer.source_vocabulary_size,
            num_layers=field("encoder_layers"),
            num_encoder_layers=field("encoder_layers"),
            num_decoder_layers=field("decoder_layers"),
            hidden_dim=d,
            intermediate_dim=field("encoder_ffn_dim"),
            num_heads=field("encoder_attention_heads"),
            dropout=float(field("dropout", 0.1)),
            attention_dropout=float(field("attention_dropout", 0.0)),
            max_length=field("max_position_embeddings", 512),
            # Marian ties all three where the vocabulary is shared and the
            # output is tied; otherwise separate source and target embeddings
            # (the same values where the vocabulary is shared).
            tie_embeddings=shared and tie_output,
            tie_decoder_output=tie_output and not shared,
            normalize_first=False,
            layer_norm_epsilon=TORCH_LAYER_NORM_EPSILON,
            activation=activation,
            positional_layout="concatenated",
            embedding_scale=math.sqrt(d) if field("scale_embedding", False) else 1.0,
            output_bias=True,
        )
    except (TypeError, ValueError) as error:
        raise MarianImportError(
            f"config.json describes no model this project builds: {error}"
        ) from error


def read_tensors(folder: str):
    """The checkpoint's tensors by transformers' names, as float32 numpy arrays: a
    safetensors file's read one at a time as asked for (`CheckpointTensors`), a
    PyTorch file's all at once."""
    path = os.path.join(folder, SAFETENSORS)
    if os.path.isfile(path):
        from keras_transformer.pretrained.checkpoint_files import CheckpointTensors

        try:
            return CheckpointTensors(path)
        except ValueError as error:
            raise MarianImportError(
                f"{path} is not a whole safetensors file ({os.path.getsize(path)} bytes): "
                f"{error}. Download or copy it again."
            ) from error
    path = os.path.join(folder, TORCH_BIN)
    if os.path.isfile(path):
        try:
            import torch
        except ImportError:
            raise MarianImportError(
                f"{path} is a PyTorch file, which needs torch to read: install torch, or "
                "convert the directory to model.safetensors first."
            ) from None
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # torch raises many types for a bad file
            raise MarianImportError(f"Cannot read {path}: {error}") from error
        return {name: value.float().numpy() for name, value in state.items()}
    raise FileNotFoundError(f"{folder} has no weights: expected {SAFETENSORS} or {TORCH_BIN}.")


def from_marian(path: str):
    """A Marian / OPUS-MT model as `(keras.Model, MarianTokenizer)`.

    `path` is a local Hugging Face MarianMT directory, a Marian release folder
    (`decoder.yml`, the `.npz`, its `.vocab.yml`, `source.spm`, `target.spm`;
    `marian_npz`), or a hub name such as `Helsinki-NLP/opus-mt-de-en`
    (downloaded with huggingface_hub, which honours `HF_HUB_OFFLINE` and its
    cache).

    Example:

    >>> model, tokenizer = from_marian("opus-mt-de-en")  # doctest: +SKIP
    """
    from keras_transformer.model import build_transformer, transformer_parts
    from keras_transformer.pretrained.marian_weights import assign_weights

    hf, config, tokenizer, tensors = read_marian(path)
    model = build_transformer(config)
    assign_weights(transformer_parts(model), tensors, tokenizer, hf)
    return model, tokenizer


def read_marian(path: str):
    """`(hf_config, config, tokenizer, tensors)` of the Marian model at `path` (as
    `from_marian` takes it), the tensors read when asked for."""
    from keras_transformer.data.marian_tokenizer import MarianTokenizer
    from keras_transformer.pretrained.marian_npz import is_native, read_native

    folder = local_directory(path)
    if is_native(folder) and not os.path.isfile(os.path.join(folder, CONFIG)):
        hf, tensors, tokenizer = read_native(folder)  # Marian's own .npz release
        config = marian_config(hf, tokenizer)
    else:
        hf = read_config(folder)
        tokenizer = MarianTokenizer.load(folder)
        config = marian_config(hf, tokenizer)
        tensors = read_tensors(folder)
    # A zero decoder-start row (every model converted from Marian's own) stays zero
    # in fine-tuning, as Marian, CTranslate2 and PyTorch's padding_idx keep it.
    if _zero_start_row(hf, tensors):
        config = dataclasses.replace(config, zero_start_embedding=True)
    return hf, config, tokenizer, tensors


def _zero_start_row(hf: dict, tensors) -> bool:
    """Whether the checkpoint's decoder-start row is all zeros (that row alone is read)."""
    start = hf.get("decoder_start_token_id", hf.get("pad_token_id"))
    names = ("model.decoder.embed_tokens.weight", "model.shared.weight")
    name = next((n for n in names if n in tensors), None)
    if name is None or start is None:
        return False
    if hasattr(tensors, "rows"):  # a CheckpointTensors: read no more than the row
        if not 0 <= start < tensors.shape(name)[0]:
            return False
        return not np.any(tensors.rows(name, start, start + 1))
    embedding = tensors[name]
    return 0 <= start < len(embedding) and not np.any(embedding[start])


def local_directory(path: str) -> str:
    """`path` if it is a folder; otherwise a hub name, fetched into the hub cache."""
    if os.path.isdir(path):
        return path
    if os.path.exists(path) or path.count("/") != 1 or path.startswith((".", "/")):
        raise FileNotFoundError(f"{path} is neither a Marian model directory nor a hub name.")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(
            f"{path} is not a local directory, and huggingface_hub (pip install "
            "huggingface_hub) is needed to download it."
        ) from None
    patterns = [CONFIG, SAFETENSORS, TORCH_BIN, "*.spm", "*vocab.json", "generation_config.json"]
    # Read at each call (huggingface_hub reads them once, when first imported).
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        return snapshot_download(
            path,
            allow_patterns=patterns,
            local_files_only=offline,
            cache_dir=os.environ.get("HF_HUB_CACHE") or None,
        )
    except Exception as error:  # offline, unknown repository, network
        raise FileNotFoundError(f"Cannot download {path} from the hub: {error}") from error


def import_marian(source: str, out_dir: str, overwrite: bool = False) -> str:
    """Writes the run directory `out_dir` for the Marian model `source`; returns it.

    The run is built in a staging folder beside `out_dir` and renamed into
    place when whole, so a failure leaves `out_dir` as it was.
    """
    from keras_transformer.io_utils import atomic_save_model, atomic_write_json, staged_directory

    out_dir = os.fspath(out_dir)
    if os.path.isfile(out_dir):
        raise MarianImportError(f"{out_dir} is a file; the import needs a folder there.")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise MarianImportError(
            f"{out_dir} exists and is not empty; choose a new folder or pass --overwrite."
        )
    from keras_transformer.model import build_transformer, transformer_parts
    from keras_transformer.pretrained.marian_weights import checkpoint_values, source_record
    from keras_transformer.pretrained.streamed_weights import ValuesOnSave, unvalued

    hf, config, tokenizer, tensors = read_marian(source)
    # The model is written as Keras writes it, each weight read from the
    # checkpoint as Keras saves it: one tensor in memory at a time, not the model.
    with unvalued():
        model = build_transformer(config)
    values = checkpoint_values(transformer_parts(model), tensors, tokenizer, hf)
    with staged_directory(out_dir, "import") as staging:
        with ValuesOnSave(values):
            atomic_save_model(model, os.path.join(staging, "model.keras"))
        tokenizer.save(staging)
        atomic_write_json(os.path.join(staging, "imported.json"), source_record(source))
    return out_dir
