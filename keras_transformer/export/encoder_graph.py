"""The encoder ONNX graph, built node by node from the layer weights.

`source_ids (batch, source_len) int32` in; `encoder_output (batch,
source_len, hidden)`, `source_mask (batch, source_len) bool` and, per
decoder layer i, `cross_key_i`, `cross_value_i (batch, heads, source_len,
head_dim)` out: everything a decoder step needs from the source, computed
once per sentence.

Built like the decoder step (`keras_transformer.export.step_graph`) rather
than converted from TensorFlow: the converted encoder had about 300 nodes
after ONNX Runtime's optimizations (layer norms decomposed into a dozen
nodes each, shape arithmetic around the einsum projections), and some of its
projections kept a form that int8 quantization does not reach. Here every
projection is one `Gemm` over `(batch * source_len, hidden)` rows, the
layer norms are ONNX `LayerNormalization`, and the cross-attention keys and
values of all decoder layers come from one `Gemm`.

The numbers are those of the Keras layers up to the order of float32
rounding; `tests/export/test_onnx.py` checks the outputs against Keras to 1e-4.
"""

from __future__ import annotations

import numpy as np

from keras_transformer.export.graph_builder import GraphBuilder
from keras_transformer.export.step_graph import (
    feed_forward_activation,
    fused_qkv_weights,
    gemm,
    layer_norm,
    layers_activation,
    position_encoding,
    projection_weights,
    residual_block,
    weight_array,
)
from keras_transformer.ops.attention import MASKED_SCORE


def build_encoder(parts, opset=17):
    """Returns the encoder `onnx.ModelProto` for a float32 model's `TransformerParts`."""
    from onnx import TensorProto

    if opset < 17:
        raise ValueError(f"The encoder graph needs opset >= 17 (LayerNormalization). Got {opset}")
    c = parts.config
    activation = layers_activation(parts.encoder_layers, "encoder graph")
    d, n = c.hidden_dim, c.num_heads
    h = d // n
    g = GraphBuilder()

    def const(name, values):
        return g.const(name, np.array(values, np.int64))

    # Shapes: (batch, source_len) and the row layouts built from it.
    ids_shape = g.node("Shape", ["source_ids"])
    heads = g.node("Concat", [ids_shape, const("shape_heads", [n, h])], axis=0)  # (B, S, N, H)
    sequence = g.node("Concat", [ids_shape, const("shape_hidden", [d])], axis=0)  # (B, S, D)
    rows = const("shape_rows", [-1, d])

    # Padding: the mask output, an additive bias over the keys (B, 1, 1, S), and
    # whether a sentence has any token (Keras gives a query with no key zeros).
    g.node(
        "Not", [g.node("Equal", ["source_ids", g.const("pad_id", np.int32(0))])], ["source_mask"]
    )
    bias = g.node(
        "Where",
        [
            g.node("Unsqueeze", ["source_mask", const("axes_1_2", [1, 2])]),
            g.const("zero", np.float32(0.0)),
            g.const("masked", np.float32(MASKED_SCORE)),
        ],
    )
    has_key = g.node(
        "ReduceMax",
        [g.node("Cast", ["source_mask"], to=TensorProto.FLOAT)],
        axes=[1],
        keepdims=1,
    )  # (B, 1)
    has_key = g.node("Unsqueeze", [has_key, const("axes_2_3", [2, 3])])  # (B, 1, 1, 1)

    # Embedding and positions 0 .. S-1, as (B * S, D) rows.
    embedding = parts.source_embedding
    x = g.node("Gather", [g.const("embeddings", weight_array(embedding._embeddings)), "source_ids"])
    x = g.node("Mul", [x, g.const("embedding_scale", np.float32(embedding._scale))])
    length = g.node("Squeeze", [g.node("Shape", ["source_ids"], start=1, end=2)])
    positions = g.node(
        "Range", [g.const("start", np.int64(0)), length, g.const("delta", np.int64(1))]
    )
    encoding = position_encoding(
        g,
        positions,
        np.asarray(embedding._table, np.float32),
        np.asarray(embedding._frequencies, np.float32),
        embedding.positional_layout,
    )
    x = g.node("Reshape", [g.node("Add", [x, encoding]), rows])

    def split_heads(projected, perm):
        """(B * S, D) rows -> (B, S, N, H), transposed by `perm`."""
        return g.node("Transpose", [g.node("Reshape", [projected, heads])], perm=perm)

    def self_attention(y, mha, prefix):
        qkv = gemm(g, y, *fused_qkv_weights(mha, d, h), f"{prefix}.qkv")
        q, k, v = g.node(
            "Split",
            [qkv, const(f"{prefix}.split", [d, d, d])],
            outputs=[f"{prefix}.q", f"{prefix}.k", f"{prefix}.v"],
            axis=1,
        )
        scores = g.node(
            "MatMul", [split_heads(q, [0, 2, 1, 3]), split_heads(k, [0, 2, 3, 1])]
        )  # (B, N, S, S)
        weights = g.node("Softmax", [g.node("Add", [scores, bias])], axis=-1)
        attended = g.node("MatMul", [weights, split_heads(v, [0, 2, 1, 3])])  # (B, N, S, H)
        attended = g.node("Mul", [attended, has_key])
        attended = g.node("Transpose", [attended], perm=[0, 2, 1, 3])  # (B, S, N, H)
        wo, bo = projection_weights(mha.output_dense, d)
        return gemm(g, g.node("Reshape", [attended, rows]), wo, bo, f"{prefix}.out")

    def feed_forward(y, ff, prefix):
        inner = feed_forward_activation(
            g,
            gemm(
                g,
                y,
                weight_array(ff.intermediate_dense.kernel),
                weight_array(ff.intermediate_dense.bias),
                f"{prefix}.ff_in",
            ),
            activation,
        )
        return gemm(
            g,
            inner,
            weight_array(ff.output_dense.kernel),
            weight_array(ff.output_dense.bias),
            f"{prefix}.ff_out",
        )

    for i, layer in enumerate(parts.encoder_layers):
        p = f"encoder_{i}"
        x = residual_block(
            g,
            x,
            lambda y, layer=layer, p=p: self_attention(y, layer.self_attention, p),
            layer.self_attention_norm,
            f"{p}.self_norm",
            c.normalize_first,
        )
        x = residual_block(
            g,
            x,
            lambda y, layer=layer, p=p: feed_forward(y, layer.feed_forward, p),
            layer.feed_forward_norm,
            f"{p}.ff_norm",
            c.normalize_first,
        )
    if parts.encoder_final_norm is not None:
        x = layer_norm(g, x, parts.encoder_final_norm, "encoder_final_norm")
    g.node("Reshape", [x, sequence], ["encoder_output"])

    # The cross-attention keys and values of every decoder layer: one product,
    # then (B, S, 2 * layers * N, H) -> heads first -> one output per layer and kind.
    kernels, biases, names = [], [], []
    for i, layer in enumerate(parts.decoder_layers):
        for kind in ("key", "value"):
            kernel, bias_ = projection_weights(getattr(layer.cross_attention, f"{kind}_dense"), d)
            kernels.append(kernel)
            biases.append(bias_)
            names.append(f"cross_{kind}_{i}")
    projected = gemm(g, x, np.concatenate(kernels, 1), np.concatenate(biases), "cross_kv")
    all_heads = g.node(
        "Concat", [ids_shape, const("shape_cross_heads", [len(names) * n, h])], axis=0
    )
    cross = g.node(
        "Transpose", [g.node("Reshape", [projected, all_heads])], perm=[0, 2, 1, 3]
    )  # (B, 2 * layers * N, S, H)
    g.node("Split", [cross, const("split_cross", [n] * len(names))], names, axis=1)

    f32 = TensorProto.FLOAT
    outputs = [
        g.value_info("encoder_output", f32, ["batch", "source_len", d]),
        g.value_info("source_mask", TensorProto.BOOL, ["batch", "source_len"]),
    ] + [g.value_info(name, f32, ["batch", n, "source_len", h]) for name in names]
    inputs = [g.value_info("source_ids", TensorProto.INT32, ["batch", "source_len"])]
    return g.model("encoder", inputs, outputs, opset=opset)
