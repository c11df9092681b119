"""The teacher-forced decoder graphs: every target position in one pass, built node by node.

Forced scoring and alignment read the whole target at once. Each graph takes
the encoder graph's outputs (`source_mask` and the cross keys and values,
once per sentence) and `target_ids (batch, target_len) int32` (BOS, then the
target), and runs the decoder layers of the step graph (`step_graph.decoder_layers`:
the same weights, nodes and order of operations) over all positions, with
causal self-attention instead of the cache. Only the positions whose input
is not padding go through the row-wise products (projections, feed-forwards,
norms, the output layer); attention alone sees the padded layout:

- `forced_scores`: also `labels (batch, target_len) int32` -> `label_log_probs
  (positions,) float32`, the log-probability of the label at each position
  whose input is not padding, in row order: a float32 `LogSoftmax` and a
  gather in the graph, so that one number per label leaves it;
- `alignment`: -> `alignment_weights (batch, target_len, source_len)`, the
  cross-attention of `spec.alignment_layer` averaged over heads, computed no
  further than that layer;
- `teacher_forced`: -> `log_probs (batch, target_len, vocabulary)`, the whole
  distribution at every position (the search specification's view of the
  model in the tests; and for users who want it).

They replace the tf2onnx conversion of the Keras model that gave logits and
alignments before format 8: that graph ran the encoder again, copied the
whole `(batch, target_len, vocabulary)` logits out for a float64 softmax in
numpy, and computed the logits when only the alignment was read.
"""

from __future__ import annotations

import numpy as np
from keras_transformer_runtime.specials import PAD_ID

from keras_transformer.export.graph_builder import GraphBuilder
from keras_transformer.export.step_graph import (
    cross_cache_inputs,
    decoder_layers,
    fused_qkv_weights,
    gemm,
    output_logits,
    projection_weights,
    target_embedding,
)
from keras_transformer.ops.attention import MASKED_SCORE

# The graph of each output, by name in the export.
FORCED_GRAPHS = {
    "forced_scores": "label_log_probs",
    "alignment": "alignment_weights",
    "teacher_forced": "log_probs",
}


def build_teacher_forced(parts, output="label_log_probs", opset=17):
    """Returns the teacher-forced `onnx.ModelProto` giving `output` (a value of
    `FORCED_GRAPHS`) for a float32 model's `TransformerParts`; see the module."""
    from onnx import TensorProto

    if output not in FORCED_GRAPHS.values():
        raise ValueError(f"output must be one of {sorted(FORCED_GRAPHS.values())}; got {output!r}")
    if opset < 17:
        raise ValueError(f"The decoder graphs need opset >= 17 (LayerNormalization). Got {opset}")
    c = parts.config
    d, n = c.hidden_dim, c.num_heads
    h = d // n
    g = GraphBuilder()

    length = g.dimension("target_ids", 1)  # (1,) int64: T
    tokens = g.reshape("target_ids", [-1])  # (B * T,), each sentence's positions in turn
    positions = g.node(
        "Range", [g.int64s(0), g.squeeze(length, [0]), g.int64s(1)], "positions_range"
    )
    x, encoding = target_embedding(g, parts, tokens, positions)
    by_position = g.node("Concat", [g.int64s([-1]), length, g.int64s([d])], axis=0)
    x = g.reshape(g.node("Add", [g.reshape(x, by_position), encoding]), [-1, d])
    # Only the real target positions (not padding) go through the row-wise
    # products (projections, feed-forwards, norms, the output layer): packed,
    # and spread out to the (batch, target_len) layout for attention alone.
    # In a batch of mixed lengths that skips a quarter to a half of the work.
    real = g.node("Not", [g.node("Equal", [tokens, g.const("pad_id", np.int32(PAD_ID))])])
    real_count = g.node("ReduceSum", [g.cast(real, TensorProto.INT64)], keepdims=1)  # (1,)
    # Each row's place among the packed rows, or past them (a zero row) for padding.
    place = g.node(
        "Sub", [g.node("CumSum", [g.cast(real, TensorProto.INT64), g.int64s(0)]), g.int64s(1)]
    )
    place = g.node("Where", [real, place, real_count])

    def spread(v):  # (packed, w) -> (B * T, w), zeros at padding
        with_zero_row = g.node("Pad", [v, g.int64s([0, 0, 1, 0])])
        return g.node("Gather", [with_zero_row, place], axis=0)

    def pack(v):
        return g.node("Compress", [v, real], axis=0)

    x = pack(x)

    # Causal mask (T, T): a position attends to itself and those before it.
    column = g.unsqueeze(positions, [0])
    row = g.unsqueeze(positions, [1])
    causal = g.node(
        "Where",
        [
            g.node("Greater", [column, row]),
            g.const("causal_masked", np.float32(MASKED_SCORE)),
            g.const("causal_zero", np.float32(0.0)),
        ],
    )
    # (B * T, 3D) -> (B, T, 3N, H) -> (B, 3N, T, H): split on the heads axis.
    qkv_shape = g.node("Concat", [g.int64s([-1]), length, g.int64s([3 * n, h])], axis=0)
    three_parts = g.int64s([n, n, n])

    def self_attention(y, layer, i):
        sa, p = layer.self_attention, f"layer_{i}"
        qkv = spread(gemm(g, y, *fused_qkv_weights(sa, d, h), f"{p}.self_qkv"))
        heads = g.node("Transpose", [g.reshape(qkv, qkv_shape)], perm=[0, 2, 1, 3])
        q, k, v = g.node(
            "Split", [heads, three_parts], outputs=[f"{p}.q", f"{p}.k", f"{p}.v"], axis=1
        )
        scores = g.node("MatMul", [q, g.node("Transpose", [k], perm=[0, 1, 3, 2])])
        weights = g.node("Softmax", [g.node("Add", [scores, causal])], axis=-1)  # (B, N, T, T)
        attended = g.node("Transpose", [g.node("MatMul", [weights, v])], perm=[0, 2, 1, 3])
        attended = pack(g.reshape(attended, [-1, d]))
        return gemm(g, attended, *projection_weights(sa.output_dense, d), f"{p}.self_out")

    found = decoder_layers(
        g,
        parts,
        x,
        self_attention,
        opset,
        alignment=output == "alignment_weights",
        spread=spread,
        pack=pack,
    )
    inputs = [g.value_info("target_ids", TensorProto.INT32, ["batch", "target_len"])]
    inputs += cross_cache_inputs(g, parts)
    f32 = TensorProto.FLOAT
    if output == "alignment_weights":
        g.output("Identity", [found], output)
        shape = ["batch", "target_len", "source_len"]
        return g.model("alignment", inputs, [g.value_info(output, f32, shape)], opset=opset)
    if output == "log_probs":
        log_probs = g.node("LogSoftmax", [output_logits(g, parts, spread(found))], axis=-1)
        by_row = g.node("Concat", [g.int64s([-1]), length, g.int64s([c.vocabulary_size])], axis=0)
        g.output("Reshape", [log_probs, by_row], output)
        shape = ["batch", "target_len", c.vocabulary_size]
        return g.model("teacher_forced", inputs, [g.value_info(output, f32, shape)], opset=opset)
    # The packed rows are the positions whose input is not padding: one label each.
    log_probs = g.node("LogSoftmax", [output_logits(g, parts, found)], axis=-1)
    labels = pack(g.reshape("labels", [-1]))
    picked = g.node("GatherElements", [log_probs, g.unsqueeze(labels, [1])], axis=1)
    g.output("Squeeze", [picked, g.int64s([1])], output)
    inputs.append(g.value_info("labels", TensorProto.INT32, ["batch", "target_len"]))
    return g.model("forced_scores", inputs, [g.value_info(output, f32, ["positions"])], opset=opset)
