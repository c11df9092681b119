"""The position-wise feed-forward network of section 3.3."""

from __future__ import annotations

import keras
from keras import ops

from keras_transformer.checks import check_positive_int, check_rate
from keras_transformer.layers.dropout import Dropout
from keras_transformer.layers.initializers import clone_initializer
from keras_transformer.ops.linear import linear


@keras.saving.register_keras_serializable(package="keras_transformer")
class FeedForward(keras.layers.Layer):
    """FFN(x) = max(0, x W1 + b1) W2 + b2, applied to every position alike.

    Args:
        hidden_dim: int. Width of the input and output (d_model).
        intermediate_dim: int. Inner width (d_ff).
        dropout: float. Dropout rate after the ReLU (0 in the paper).
        activation: activation of the inner layer, ReLU as in the paper.
        kernel_initializer: initializer of both kernels.

    Call arguments:
        inputs: `(batch_size, seq_len, hidden_dim)`.
        training: bool. Whether dropout is active.

    Returns:
        `(batch_size, seq_len, hidden_dim)`.

    Example:

    >>> ffn = FeedForward(hidden_dim=8, intermediate_dim=32)
    >>> tuple(ffn(np.zeros((2, 3, 8), "float32")).shape)
    (2, 3, 8)
    """

    def __init__(
        self,
        hidden_dim,
        intermediate_dim,
        dropout=0.0,
        activation="relu",
        kernel_initializer="glorot_uniform",
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_positive_int("hidden_dim", hidden_dim)
        check_positive_int("intermediate_dim", intermediate_dim)
        check_rate("dropout", dropout)
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.dropout = float(dropout)
        self.activation = keras.activations.get(activation)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.intermediate_dense = keras.layers.Dense(
            intermediate_dim,
            activation=self.activation,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            dtype=self.dtype_policy,
            name="intermediate_dense",
        )
        self.dropout_layer = Dropout(self.dropout, dtype=self.dtype_policy, name="dropout_layer")
        self.output_dense = keras.layers.Dense(
            hidden_dim,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            dtype=self.dtype_policy,
            name="output_dense",
        )

    def build(self, inputs_shape):
        self.intermediate_dense.build(inputs_shape)
        self.output_dense.build(tuple(inputs_shape[:-1]) + (self.intermediate_dim,))
        self.built = True

    def _dense(self, dense, rows):
        """`dense` applied to the 2-D `rows` as one `linear` product.

        The `Dense` layers hold the weights (checkpoints and the ONNX export
        read them there); `linear` gives TensorFlow a hand-written backward
        pass (`keras_transformer.ops.hand_written_gradients("feed_forward")`): the bias gradients
        as `column_sum` products instead of broadcast reductions over
        (tokens, 2048) and (tokens, 512), the input gradients against a
        written-out transposed kernel.
        """
        kernel = ops.cast(dense.kernel, self.compute_dtype)
        bias = ops.cast(dense.bias, self.compute_dtype)
        return linear(rows, kernel, bias, part="feed_forward")

    def call(self, inputs, training=None):
        rows = ops.reshape(inputs, (-1, self.hidden_dim))
        x = self._dense(self.intermediate_dense, rows)
        if getattr(self.activation, "__name__", "") == "gelu":
            # The exact GELU written with erf: TensorFlow's own uses erfc,
            # which the ONNX converter does not know.
            x = 0.5 * x * (1.0 + ops.erf(x * ops.cast(0.7071067811865476, x.dtype)))
        else:
            x = self.activation(x)
        x = self.dropout_layer(x, training=training)
        y = self._dense(self.output_dense, x)
        return ops.reshape(y, ops.shape(inputs))

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape[:-1]) + (self.hidden_dim,)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "hidden_dim": self.hidden_dim,
                "intermediate_dim": self.intermediate_dim,
                "dropout": self.dropout,
                "activation": keras.activations.serialize(self.activation),
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            }
        )
        return config
