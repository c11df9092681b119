"""The encoder-decoder Transformer assembled with the functional API."""

from __future__ import annotations

import dataclasses

import keras
from keras import ops

from keras_transformer.config import TransformerConfig
from keras_transformer.layers import DecoderLayer, EncoderLayer, PaddingMask, PositionalEmbedding
from keras_transformer.layers.layer_normalization import LayerNormalization
from keras_transformer.layers.masks import padding_mask_from_ids


def build_transformer(config: TransformerConfig, name: str = "transformer") -> keras.Model:
    """Builds the paper's encoder-decoder Transformer as a functional `keras.Model`.

    Inputs are a dict `{"source_ids": (batch_size, source_len) int32,
    "target_ids": (batch_size, target_len) int32}` with padding id 0;
    `target_ids` is the decoder input (BOS + target). The output is float32
    logits `(batch_size, target_len, vocabulary_size)`.

    The layers take the global dtype policy, so call
    `keras.mixed_precision.set_global_policy(...)` first for mixed precision.

    Example:

    >>> config = TransformerConfig.from_preset("tiny")
    >>> model = build_transformer(config)
    >>> logits = model({"source_ids": np.array([[5, 6, 2]]), "target_ids": np.array([[1, 7]])})
    >>> tuple(logits.shape)
    (1, 2, 64)
    """
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"config must be a TransformerConfig. Received: {type(config).__name__}")
    source_ids = keras.Input(shape=(None,), dtype="int32", name="source_ids")
    target_ids = keras.Input(shape=(None,), dtype="int32", name="target_ids")
    source_mask = PaddingMask(name="source_padding_mask")(source_ids)
    target_mask = PaddingMask(name="target_padding_mask")(target_ids)

    tied_output = config.tie_embeddings or config.tie_decoder_output

    def embedding(layer_name, vocabulary_size, output_bias=False):
        return PositionalEmbedding(
            vocabulary_size,
            config.hidden_dim,
            config.max_length,
            dropout=config.dropout,
            positional_layout=config.positional_layout,
            embedding_scale=config.embedding_scale,
            output_bias=output_bias,
            zero_start=config.zero_start_embedding and layer_name != "source_embedding",
            name=layer_name,
        )

    if config.tie_embeddings:
        source_embedding = target_embedding = embedding(
            "token_embedding", config.vocabulary_size, config.output_bias
        )
    else:
        source_embedding = embedding("source_embedding", config.source_vocabulary_size)
        target_embedding = embedding(
            "target_embedding", config.vocabulary_size, tied_output and config.output_bias
        )

    block = dict(
        hidden_dim=config.hidden_dim,
        intermediate_dim=config.intermediate_dim,
        num_heads=config.num_heads,
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        normalize_first=config.normalize_first,
        layer_norm_epsilon=config.layer_norm_epsilon,
        activation=config.activation,
    )
    x = source_embedding(source_ids)
    for i in range(config.num_encoder_layers):
        x = EncoderLayer(**block, name=f"encoder_layer_{i}")(x, padding_mask=source_mask)
    if config.normalize_first:
        x = _final_norm(config, "encoder_final_norm")(x)

    y = target_embedding(target_ids)
    for i in range(config.num_decoder_layers):
        y = DecoderLayer(**block, name=f"decoder_layer_{i}")(
            y, x, decoder_padding_mask=target_mask, encoder_padding_mask=source_mask
        )
    if config.normalize_first:
        y = _final_norm(config, "decoder_final_norm")(y)

    if tied_output:
        logits = target_embedding(y, reverse=True)
    else:
        projected = keras.layers.Dense(
            config.vocabulary_size, use_bias=True, name="output_projection"
        )(y)
        logits = keras.layers.Activation("linear", dtype="float32", name="logits")(projected)
    return keras.Model({"source_ids": source_ids, "target_ids": target_ids}, logits, name=name)


def _final_norm(config, name):
    return LayerNormalization(epsilon=config.layer_norm_epsilon, name=name)


@dataclasses.dataclass
class TransformerParts:
    """The layers of a model from `build_transformer`, found by name.

    Works on a freshly built model and on one loaded from a `.keras` file, so
    decoding and export need nothing but the model.
    """

    config: TransformerConfig
    source_embedding: PositionalEmbedding
    target_embedding: PositionalEmbedding
    encoder_layers: list
    decoder_layers: list
    encoder_final_norm: keras.layers.Layer | None
    decoder_final_norm: keras.layers.Layer | None
    output_projection: keras.layers.Layer | None  # None when tied to the embedding

    def encode(self, source_ids, training=False):
        """Returns `(encoder_output, source_padding_mask)`."""
        source_ids = ops.convert_to_tensor(source_ids, "int32")
        mask = padding_mask_from_ids(source_ids)
        x = self.source_embedding(source_ids, training=training)
        for layer in self.encoder_layers:
            x = layer(x, padding_mask=mask, training=training)
        if self.encoder_final_norm is not None:
            x = self.encoder_final_norm(x)
        return x, mask

    def project(self, hidden):
        """Final norm (pre-norm models) and output projection: float32 logits."""
        if self.decoder_final_norm is not None:
            hidden = self.decoder_final_norm(hidden)
        if self.output_projection is None:
            return self.target_embedding(hidden, reverse=True)
        return ops.cast(self.output_projection(hidden), "float32")

    def decode(self, target_ids, encoder_output, source_mask, training=False):
        """Full (uncached) decoder pass: float32 logits for every target position."""
        return self.project(
            self.decode_hidden(target_ids, encoder_output, source_mask, training=training)
        )

    def decode_hidden(self, target_ids, encoder_output, source_mask, training=False):
        """Full decoder pass up to the last decoder layer (before `project`)."""
        target_ids = ops.convert_to_tensor(target_ids, "int32")
        target_mask = padding_mask_from_ids(target_ids)
        y = self.target_embedding(target_ids, training=training)
        for layer in self.decoder_layers:
            y = layer(
                y,
                encoder_output,
                decoder_padding_mask=target_mask,
                encoder_padding_mask=source_mask,
                training=training,
            )
        return y

    def cross_attention_weights(self, source_ids, target_ids):
        """Teacher-forced cross-attention weights of every decoder layer.

        Args:
            source_ids: `(batch_size, source_len)` int.
            target_ids: `(batch_size, target_len)` int, the decoder input (BOS first).

        Returns:
            A list with one float32 `(batch_size, num_heads, target_len, source_len)`
            array-like per decoder layer, first layer first.
        """
        return self.logits_and_cross_attention(source_ids, target_ids)[1]

    def logits_and_cross_attention(self, source_ids, target_ids):
        """Teacher-forced float32 logits `(batch_size, target_len, vocabulary_size)` and
        the cross-attention weights of every decoder layer (as
        `cross_attention_weights`), from one pass."""
        encoder_output, source_mask = self.encode(source_ids)
        target_ids = ops.convert_to_tensor(target_ids, "int32")
        target_mask = padding_mask_from_ids(target_ids)
        y = self.target_embedding(target_ids)
        weights = []
        for layer in self.decoder_layers:
            y, scores = layer(
                y,
                encoder_output,
                decoder_padding_mask=target_mask,
                encoder_padding_mask=source_mask,
                return_attention_scores=True,
            )
            weights.append(ops.cast(scores, "float32"))
        return self.project(y), weights


def transformer_parts(model: keras.Model) -> TransformerParts:
    """Finds the layers of a `build_transformer` model and recovers its config."""
    names = {layer.name: layer for layer in model.layers}
    if "token_embedding" in names:
        source_embedding = target_embedding = names["token_embedding"]
        output_projection = None
    elif "source_embedding" in names and "target_embedding" in names:
        source_embedding = names["source_embedding"]
        target_embedding = names["target_embedding"]
        output_projection = names.get("output_projection")
    else:
        raise ValueError(
            f"Model {model.name!r} was not built by build_transformer: it has no "
            "'token_embedding' (or 'source_embedding'/'target_embedding') layer."
        )

    def stack(kind):
        found = [layer for layer in model.layers if isinstance(layer, kind)]
        return sorted(found, key=lambda layer: int(layer.name.rsplit("_", 1)[-1]))

    encoder_layers = stack(EncoderLayer)
    decoder_layers = stack(DecoderLayer)
    if not encoder_layers or not decoder_layers:
        raise ValueError(
            f"Model {model.name!r} has {len(encoder_layers)} encoder and "
            f"{len(decoder_layers)} decoder layers; expected at least one of each."
        )
    first = encoder_layers[0]
    tied = source_embedding is target_embedding
    config = TransformerConfig(
        vocabulary_size=target_embedding.vocabulary_size,
        source_vocabulary_size=source_embedding.vocabulary_size,
        num_layers=len(encoder_layers),
        num_encoder_layers=len(encoder_layers),
        num_decoder_layers=len(decoder_layers),
        hidden_dim=first.hidden_dim,
        intermediate_dim=first.intermediate_dim,
        num_heads=first.num_heads,
        dropout=first.dropout,
        attention_dropout=first.attention_dropout,
        max_length=source_embedding.max_length,
        tie_embeddings=tied,
        tie_decoder_output=not tied and output_projection is None,
        normalize_first=first.normalize_first,
        layer_norm_epsilon=first.layer_norm_epsilon,
        activation=first.activation,
        positional_layout=source_embedding.positional_layout,
        embedding_scale=source_embedding.embedding_scale,
        output_bias=target_embedding.output_bias,
        zero_start_embedding=target_embedding.zero_start,
    )
    return TransformerParts(
        config=config,
        source_embedding=source_embedding,
        target_embedding=target_embedding,
        encoder_layers=encoder_layers,
        decoder_layers=decoder_layers,
        encoder_final_norm=names.get("encoder_final_norm"),
        decoder_final_norm=names.get("decoder_final_norm"),
        output_projection=output_projection,
    )
