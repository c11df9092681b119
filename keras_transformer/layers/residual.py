"""The residual wiring, norms and validation shared by the encoder and decoder layers."""

from __future__ import annotations

import keras

from keras_transformer.checks import check_positive_int, check_rate
from keras_transformer.layers.dropout import Dropout
from keras_transformer.layers.layer_normalization import LayerNormalization


class ResidualBlockMixin:
    """Residual wiring shared by the encoder and decoder layers.

    Post-norm (the paper): x = LayerNorm(x + Dropout(sublayer(x))).
    Pre-norm: x = x + Dropout(sublayer(LayerNorm(x))).
    """

    def _residual(self, x, norm, dropout, sublayer, training):
        y = norm(x) if self.normalize_first else x
        y = dropout(sublayer(y), training=training)
        x = x + y
        return x if self.normalize_first else norm(x)

    def _norm(self, name):
        return LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name=name
        )

    def _attention_rate(self):
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    def _dropout(self, name):
        return Dropout(self.dropout, dtype=self.dtype_policy, name=name)

    def _validate(self, hidden_dim, intermediate_dim, num_heads, dropout, attention_dropout):
        check_positive_int("hidden_dim", hidden_dim)
        check_positive_int("intermediate_dim", intermediate_dim)
        check_positive_int("num_heads", num_heads)
        check_rate("dropout", dropout)
        if attention_dropout is not None:
            check_rate("attention_dropout", attention_dropout)
        if hidden_dim % num_heads:
            raise ValueError(
                "hidden_dim must be divisible by num_heads. Received: "
                f"hidden_dim={hidden_dim}, num_heads={num_heads}"
            )

    def _block_config(self):
        return {
            "hidden_dim": self.hidden_dim,
            "intermediate_dim": self.intermediate_dim,
            "num_heads": self.num_heads,
            "dropout": self.dropout,
            "attention_dropout": self.attention_dropout,
            "normalize_first": self.normalize_first,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "activation": self.activation,
        }
