"""`export --format marian-hf`: a run with a Marian tokenizer back to a Hugging Face
MarianMT directory, which transformers and CTranslate2's converter load.

The inverse of `keras_transformer.pretrained.marian.import_marian`, through
the same weight table (`marian_weights.weight_table`). A model that Marian
cannot express (the paper's interleaved sinusoids, pre-norm layers, another
LayerNorm epsilon, our own SentencePiece vocabulary) is refused by name.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from keras_transformer.pretrained.marian import (
    CONFIG,
    SAFETENSORS,
    TORCH_LAYER_NORM_EPSILON,
    MarianImportError,
)

ACTIVATION_NAMES = {"relu": "relu", "swish": "swish", "gelu": "gelu"}


def marian_hf_config(config, tokenizer) -> dict:
    """transformers' `MarianConfig` fields for our `config` and Marian `tokenizer`."""

    def refuse(why):
        raise MarianImportError(f"This model cannot be written as a MarianMT model: {why}.")

    if config.positional_layout != "concatenated":
        refuse(f"positional_layout={config.positional_layout!r} (Marian's is 'concatenated')")
    if config.normalize_first:
        refuse("normalize_first=True (Marian's layers are post-norm)")
    if not math.isclose(config.layer_norm_epsilon, TORCH_LAYER_NORM_EPSILON):
        refuse(f"layer_norm_epsilon={config.layer_norm_epsilon} (MarianMT's is 1e-5)")
    scale = config.embedding_scale
    if scale is None or math.isclose(scale, math.sqrt(config.hidden_dim)):
        scale_embedding = True
    elif math.isclose(scale, 1.0):
        scale_embedding = False
    else:
        refuse(f"embedding_scale={scale} (MarianMT scales by sqrt(d) or 1)")
    source, target = tokenizer.source.vocabulary, tokenizer.target.vocabulary
    shared = not tokenizer.separate_vocabularies
    tie_output = config.tie_embeddings or config.tie_decoder_output
    if shared and not config.tie_embeddings and tie_output:
        refuse("one vocabulary with separate source and target embeddings")
    eos, pad = target["</s>"], target["<pad>"]
    return {
        "model_type": "marian",
        "architectures": ["MarianMTModel"],
        "d_model": config.hidden_dim,
        "encoder_layers": config.num_encoder_layers,
        "decoder_layers": config.num_decoder_layers,
        "encoder_attention_heads": config.num_heads,
        "decoder_attention_heads": config.num_heads,
        "encoder_ffn_dim": config.intermediate_dim,
        "decoder_ffn_dim": config.intermediate_dim,
        "activation_function": ACTIVATION_NAMES[config.activation],
        "vocab_size": len(source),
        "decoder_vocab_size": len(target),
        "share_encoder_decoder_embeddings": shared,
        "tie_word_embeddings": tie_output,
        "scale_embedding": scale_embedding,
        "max_position_embeddings": config.max_length,
        "dropout": config.dropout,
        "attention_dropout": (
            config.dropout if config.attention_dropout is None else config.attention_dropout
        ),
        "activation_dropout": 0.0,
        "pad_token_id": pad,
        "eos_token_id": eos,
        "decoder_start_token_id": pad,
        "forced_eos_token_id": eos,
        "bad_words_ids": [[pad]],
        "is_encoder_decoder": True,
    }


def export_marian_hf(run_dir: str, out_dir: str, overwrite: bool = False) -> list[str]:
    """Writes the Hugging Face MarianMT directory `out_dir` for the run `run_dir`;
    returns the files written. Built in a staging folder and renamed into place."""
    import keras

    from keras_transformer.data.marian_tokenizer import MarianTokenizer
    from keras_transformer.io_utils import staged_directory, unpacked_keras_archive
    from keras_transformer.model import transformer_parts
    from keras_transformer.pretrained.marian_weights import weight_table
    from keras_transformer.pretrained.streamed_weights import unvalued
    from keras_transformer.translation import (
        check_keras_archive,
        load_tokenizer,
        run_model_path,
    )

    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.isfile(out_dir):
        raise MarianImportError(f"{out_dir} is a file; the export needs a folder there.")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        if not os.path.isfile(os.path.join(out_dir, CONFIG)) or not overwrite:
            raise MarianImportError(
                f"{out_dir} exists and is not empty; choose a new folder"
                + (
                    " or pass --overwrite."
                    if os.path.isfile(os.path.join(out_dir, CONFIG))
                    else "."
                )
            )
    model_path = run_model_path(run_dir)
    tokenizer = load_tokenizer(run_dir)
    if not isinstance(tokenizer, MarianTokenizer):
        raise MarianImportError(
            f"{run_dir} has no Marian tokenizer (vocab.json with source.spm and target.spm): "
            "only imported or fine-tuned Marian models export as marian-hf."
        )
    check_keras_archive(model_path)
    with unpacked_keras_archive(model_path) as unpacked:
        # The model without values; its weights are read from the file one at a
        # time, each written out as it comes (`_write_weights`).
        with open(os.path.join(unpacked, "config.json"), encoding="utf-8") as f:
            saved = json.load(f)
        saved.pop("compile_config", None)  # the optimizer of a trained run: not exported
        with unvalued():
            model = keras.models.model_from_json(json.dumps(saved))
        parts = transformer_parts(model)
        config = marian_hf_config(parts.config, tokenizer)
        with staged_directory(out_dir, "marian") as staging:
            _write_weights(
                model,
                weight_table(parts, tokenizer),
                os.path.join(unpacked, "model.weights.h5"),
                os.path.join(staging, SAFETENSORS),
                config["share_encoder_decoder_embeddings"],
            )
            for name, data in _configs(config, tokenizer):
                with open(os.path.join(staging, name), "w", encoding="utf-8") as f:
                    json.dump(data, f, indent=2)
                    f.write("\n")
            files = sorted(os.listdir(staging) + tokenizer.save(staging))
    return sorted(set(files))


def _write_weights(model, table, weights_file, path, shared_vocabulary):
    """The safetensors file `path` of `model`'s weights, each read from Keras's
    `weights_file` as Keras loads it and written out at once (`TakeOnLoad`)."""
    from keras_transformer.pretrained.checkpoint_files import SafetensorsWriter
    from keras_transformer.pretrained.marian_weights import marian_order
    from keras_transformer.pretrained.streamed_weights import TakeOnLoad

    entries = {id(entry.variable): entry for entry in table}
    # One vocabulary, an output of its own: transformers then keeps the encoder's
    # and decoder's embeddings apart from the shared module, and saves all three.
    add_shared = shared_vocabulary and all(
        entry.names[0] != "model.shared.weight" for entry in table
    )
    with SafetensorsWriter(path, {"format": "pt"}) as writer:

        def take(variable, value):
            entry = entries.pop(id(variable))
            name = entry.names[0]
            value = np.asarray(value, np.float32)
            if entry.rows is None:
                value, rows = entry.to_marian(value), None
            else:  # a vocabulary matrix: its rows written in Marian's order, a block at a time
                rows = marian_order(entry.rows)
            writer.add(name, value, rows)
            if add_shared and name == "model.encoder.embed_tokens.weight":
                writer.add("model.shared.weight", value, rows)

        with TakeOnLoad(take):
            model.load_weights(weights_file)
        if entries:
            raise MarianImportError(
                f"{weights_file} holds no weights for {len(entries)} variable(s), such as "
                f"{next(iter(entries.values())).variable.path}."
            )


def _configs(config, tokenizer):
    """transformers' config, generation config and tokenizer config, by file name."""
    generation = {
        key: config[key]
        for key in ("pad_token_id", "eos_token_id", "decoder_start_token_id", "bad_words_ids")
    }
    generation.update(
        forced_eos_token_id=config["eos_token_id"], max_length=config["max_position_embeddings"]
    )
    tokenizer_config = {
        "tokenizer_class": "MarianTokenizer",
        "separate_vocabs": tokenizer.separate_vocabularies,
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "model_max_length": config["max_position_embeddings"],
    }
    return [
        (CONFIG, config),
        ("generation_config.json", generation),
        ("tokenizer_config.json", tokenizer_config),
    ]
