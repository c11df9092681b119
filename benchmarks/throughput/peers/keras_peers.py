"""The Keras peers: this package, keras-hub's layers, and a keras.layers.MultiHeadAttention build.

Each `build_*` function returns an uncompiled functional model with the
inputs `source_ids` and `target_ids` and float32 logits; `KerasPeer` compiles
it with the package's optimizer and loss and steps it with `train_on_batch`.
"""

from __future__ import annotations

import math


def _keras_compile(model, config, jit_compile):
    from keras_transformer.losses import LabelSmoothedCrossEntropy
    from keras_transformer.schedules import transformer_optimizer

    model.compile(
        optimizer=transformer_optimizer(config.hidden_dim, warmup_steps=4000),
        loss=LabelSmoothedCrossEntropy(0.1),
        # Keras' "auto": XLA under JAX, none under TensorFlow on a CPU-only machine.
        jit_compile=True if jit_compile else "auto",
    )
    # Slots built now, as `train` builds them: created inside the first trace,
    # they make TensorFlow trace the step twice (compile time, not step time).
    model.optimizer.build(model.trainable_variables)
    return model


def build_ours(config):
    from keras_transformer import build_transformer

    return build_transformer(config)


def build_keras_hub(config):
    import keras
    import keras_hub
    from keras import ops

    from keras_transformer.layers import PaddingMask

    source_ids = keras.Input(shape=(None,), dtype="int32", name="source_ids")
    target_ids = keras.Input(shape=(None,), dtype="int32", name="target_ids")
    source_mask = PaddingMask()(source_ids)
    target_mask = PaddingMask()(target_ids)
    embedding = keras_hub.layers.ReversibleEmbedding(
        config.vocabulary_size, config.hidden_dim, tie_weights=True
    )
    position = keras_hub.layers.SinePositionEncoding()
    scale = math.sqrt(config.hidden_dim)

    def embed(ids):
        x = keras.layers.Lambda(lambda e: e * ops.cast(scale, e.dtype))(embedding(ids))
        x = keras.layers.Add()([x, position(x)])
        return keras.layers.Dropout(config.dropout)(x)

    block = dict(
        intermediate_dim=config.intermediate_dim,
        num_heads=config.num_heads,
        dropout=config.dropout,
        activation="relu",
        layer_norm_epsilon=config.layer_norm_epsilon,
    )
    x = embed(source_ids)
    for _ in range(config.num_layers):
        x = keras_hub.layers.TransformerEncoder(**block)(x, padding_mask=source_mask)
    y = embed(target_ids)
    for _ in range(config.num_layers):
        y = keras_hub.layers.TransformerDecoder(**block)(
            y,
            encoder_sequence=x,
            decoder_padding_mask=target_mask,
            encoder_padding_mask=source_mask,
        )
    logits = keras.layers.Activation("linear", dtype="float32")(embedding(y, reverse=True))
    return keras.Model({"source_ids": source_ids, "target_ids": target_ids}, logits)


def build_keras_mha(config):
    """TensorFlow's Transformer tutorial architecture on keras.layers.MultiHeadAttention.

    Post-norm residual blocks (MHA + Add + LayerNorm, FFN + Add + LayerNorm),
    scaled embeddings plus the sinusoid table, separate source/target
    embeddings and an untied output Dense, as in the tutorial; the per-head
    key size is d_model / heads, as in the paper, so the shapes match.
    """
    import keras
    from keras import ops

    from keras_transformer.layers import PaddingMask
    from keras_transformer.layers.positional_embedding import sinusoid_table

    d, heads = config.hidden_dim, config.num_heads
    table = sinusoid_table(config.max_length, d)

    class TableAdd(keras.layers.Layer):
        def call(self, x):
            positions = ops.convert_to_tensor(table[None], self.compute_dtype)
            return x * ops.cast(math.sqrt(d), x.dtype) + positions[:, : ops.shape(x)[1]]

        def compute_output_shape(self, input_shape):  # JAX cannot infer it from `call`
            return input_shape

    source_ids = keras.Input(shape=(None,), dtype="int32", name="source_ids")
    target_ids = keras.Input(shape=(None,), dtype="int32", name="target_ids")
    source_mask = PaddingMask()(source_ids)
    target_mask = PaddingMask()(target_ids)

    def embed(ids):
        x = keras.layers.Embedding(config.vocabulary_size, d)(ids)
        return keras.layers.Dropout(config.dropout)(TableAdd()(x))

    def attention(x, context, query_mask, key_mask, causal):
        mha = keras.layers.MultiHeadAttention(heads, d // heads, dropout=config.dropout)
        out = mha(x, context, query_mask=query_mask, value_mask=key_mask, use_causal_mask=causal)
        return keras.layers.LayerNormalization(epsilon=config.layer_norm_epsilon)(
            keras.layers.Add()([x, out])
        )

    def feed_forward(x):
        h = keras.layers.Dense(config.intermediate_dim, activation="relu")(x)
        h = keras.layers.Dropout(config.dropout)(keras.layers.Dense(d)(h))
        return keras.layers.LayerNormalization(epsilon=config.layer_norm_epsilon)(
            keras.layers.Add()([x, h])
        )

    x = embed(source_ids)
    for _ in range(config.num_layers):
        x = feed_forward(attention(x, x, source_mask, source_mask, False))
    y = embed(target_ids)
    for _ in range(config.num_layers):
        y = attention(y, y, target_mask, target_mask, True)
        y = feed_forward(attention(y, x, target_mask, source_mask, False))
    logits = keras.layers.Dense(config.vocabulary_size, dtype="float32")(y)
    return keras.Model({"source_ids": source_ids, "target_ids": target_ids}, logits)


class KerasPeer:
    def __init__(self, name, builder, config, policy="float32", jit_compile=False):
        import keras

        self.name = name
        previous = keras.mixed_precision.global_policy().name
        keras.mixed_precision.set_global_policy(policy)
        try:
            keras.utils.set_random_seed(0)
            self.model = _keras_compile(builder(config), config, jit_compile)
        finally:
            keras.mixed_precision.set_global_policy(previous)
        self.parameters = self.model.count_params()

    def prepare(self, batch):
        from keras import ops

        x = {
            "source_ids": ops.convert_to_tensor(batch["source"]),
            "target_ids": ops.convert_to_tensor(batch["target_in"]),
        }
        return x, ops.convert_to_tensor(batch["labels"])

    def step(self, prepared):
        x, y = prepared
        return float(self.model.train_on_batch(x, y))
