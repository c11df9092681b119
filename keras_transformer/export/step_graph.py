"""The decoder-step ONNX graph, built node by node from the layer weights.

One new token per sequence in, log-probabilities and the grown self-attention
caches out. Written node by node with `GraphBuilder` rather than converted from a
TensorFlow function: the converted step had several hundred nodes after ONNX Runtime's
optimizations, mostly the shape arithmetic of the einsum projections and
decomposed layer norms, and per-node overhead dominated a batch-1 step. This
one has about 30 nodes per layer: fused projections (`Gemm`), ONNX
`LayerNormalization` (opset 17), attention as two `MatMul`s over caches laid
out `(batch, heads, length, head_dim)` so that no transpose is needed.

The numbers are those of the Keras layers (same weights, same operations up to
the order of float32 rounding); `tests/export/test_onnx.py` checks the step against
the Keras model to 1e-4.
"""

from __future__ import annotations

import numpy as np
from keras_transformer_runtime.export_format import ALIGNMENT_WEIGHTS
from keras_transformer_runtime.spec import alignment_layer, banned_ids

from keras_transformer.export.graph_builder import GraphBuilder
from keras_transformer.ops.attention import MASKED_SCORE


def weight_array(weight):
    return np.asarray(weight.numpy() if hasattr(weight, "numpy") else weight, np.float32)


def layer_norm(g, x, layer, prefix):
    """ONNX `LayerNormalization` over the last axis with a Keras layer norm's weights."""
    return g.node(
        "LayerNormalization",
        [
            x,
            g.const(f"{prefix}.gamma", weight_array(layer.gamma)),
            g.const(f"{prefix}.beta", weight_array(layer.beta)),
        ],
        axis=-1,
        epsilon=float(layer.epsilon),
    )


def gemm(g, x, kernel, bias, prefix):
    """`x (rows, in) @ kernel + bias` as one `Gemm`."""
    return g.node("Gemm", [x, g.const(f"{prefix}.kernel", kernel), g.const(f"{prefix}.bias", bias)])


def scaled_query_weights(mha, d, h):
    """The query projection of `mha` as `(d, d)` kernel and `(d,)` bias, with the
    attention's 1/sqrt(head_dim) folded in (Keras scales the projected queries)."""
    scale = np.float32(1.0 / np.sqrt(h))
    return (
        weight_array(mha.query_dense.kernel).reshape(d, d) * scale,
        weight_array(mha.query_dense.bias).reshape(d) * scale,
    )


def projection_weights(dense, d):
    """An `EinsumDense` projection `(d, heads, head_dim)` as `(d, d)` kernel and `(d,)` bias."""
    return weight_array(dense.kernel).reshape(d, -1), weight_array(dense.bias).reshape(-1)


def fused_qkv_weights(mha, d, h):
    """The query (scaled), key and value projections of `mha` as one `(d, 3d)` kernel
    and `(3d,)` bias, for a single `Gemm`."""
    parts = [scaled_query_weights(mha, d, h)] + [
        projection_weights(dense, d) for dense in (mha.key_dense, mha.value_dense)
    ]
    return np.concatenate([k for k, _ in parts], 1), np.concatenate([b for _, b in parts])


def residual_block(g, x, sublayer, norm_layer, prefix, normalize_first):
    """`x + sublayer(norm(x))` (pre-norm) or `norm(x + sublayer(x))` (the paper's post-norm)."""
    if normalize_first:
        return g.node("Add", [x, sublayer(layer_norm(g, x, norm_layer, prefix))])
    return layer_norm(g, g.node("Add", [x, sublayer(x)]), norm_layer, prefix)


def feed_forward_activation(g, x, activation):
    """The feed-forward's inner activation as ONNX nodes: ReLU, swish (x * sigmoid(x))
    or GELU in its exact erf form (opset 17 has no Gelu), as Keras computes them."""
    if activation == "relu":
        return g.node("Relu", [x])
    if activation == "swish":
        return g.node("Mul", [x, g.node("Sigmoid", [x])])
    if activation == "gelu":
        scaled = g.node("Mul", [x, g.const("gelu_inverse_sqrt2", np.float32(1 / np.sqrt(2)))])
        erf_plus_one = g.node("Add", [g.node("Erf", [scaled]), g.const("gelu_one", np.float32(1))])
        half = g.node("Mul", [x, g.const("gelu_half", np.float32(0.5))])
        return g.node("Mul", [half, erf_plus_one])
    raise ValueError(f"The export graphs build relu, swish and gelu; got {activation!r}.")


def layers_activation(layers, graph):
    """The one activation of `layers`' feed-forwards (relu, swish or gelu), or an error."""
    found = {layer.activation for layer in layers}
    if len(found) != 1 or not found <= {"relu", "swish", "gelu"}:
        raise ValueError(
            f"The {graph} builds one feed-forward activation of relu, swish and gelu; "
            f"the layers have {sorted(found)}."
        )
    return found.pop()


def position_encoding(g, position, table, frequencies, layout="interleaved"):
    """The sinusoids of `position` ((T,) int64) as `(T, d)`: from the table inside it,
    computed in float32 past it, as `positional_encoding` does in Keras (`layout`:
    the paper's interleaved sin/cos pairs, or all sines then all cosines)."""
    from onnx import TensorProto

    length, d = table.shape
    last = g.const("last_table_position", np.array([length - 1], np.int64))
    from_table = g.node(
        "Gather", [g.const("positions", table), g.node("Min", [position, last])], axis=0
    )
    angles = g.node(
        "Mul",
        [
            g.node(
                "Unsqueeze",
                [
                    g.node("Cast", [position], to=TensorProto.FLOAT),
                    g.const("axes_1", np.array([1], np.int64)),
                ],
            ),
            g.const("frequencies", frequencies[None, :]),
        ],
    )  # (T, ceil(d/2))
    if layout == "concatenated":
        flat = g.node("Concat", [g.node("Sin", [angles]), g.node("Cos", [angles])], axis=1)
    else:
        axis_2 = g.const("axes_2", np.array([2], np.int64))
        pairs = g.node(
            "Concat",
            [
                g.node("Unsqueeze", [g.node("Sin", [angles]), axis_2]),
                g.node("Unsqueeze", [g.node("Cos", [angles]), axis_2]),
            ],
            axis=2,
        )  # (T, ceil(d/2), 2)
        flat = g.node(
            "Reshape",
            [pairs, g.const("shape_pairs", np.array([-1, 2 * len(frequencies)], np.int64))],
        )
    computed = g.node(
        "Slice",
        [
            flat,
            g.const("slice_start", np.array([0], np.int64)),
            g.const("slice_end", np.array([d], np.int64)),
            g.const("slice_axis", np.array([1], np.int64)),
        ],
    )
    inside = g.node("Less", [position, g.const("table_length", np.array([length], np.int64))])
    return g.node(
        "Where",
        [
            g.node("Unsqueeze", [inside, g.const("axes_1b", np.array([1], np.int64))]),
            from_table,
            computed,
        ],
    )


def target_embedding(g, parts, tokens, position):
    """The scaled target embeddings of `tokens` ((rows,) int) plus the sinusoids of
    `position` ((T,) int64) as `(rows, d)` when T is 1; with T > 1 the caller adds
    the `(T, d)` encodings (returned second) by position itself."""
    embedding = parts.target_embedding
    table = np.asarray(embedding._table, np.float32)
    frequencies = np.asarray(embedding._frequencies, np.float32)
    x = g.node("Gather", [g.const("embeddings", output_embeddings(parts)), tokens], axis=0)
    x = g.node("Mul", [x, g.const("embedding_scale", np.float32(embedding._scale))])
    encodings = position_encoding(g, position, table, frequencies, embedding.positional_layout)
    return x, encodings


def output_embeddings(parts):
    """The target embedding matrix `(vocabulary, d)` as float32."""
    return weight_array(parts.target_embedding._embeddings)


def source_bias(g):
    """The additive mask of the source padding, `(sentences, 1, source_len, 1)`, from
    the `source_mask` input; shared by the layers' cross-attentions."""
    mask = g.node("Unsqueeze", ["source_mask", g.const("axes_1_3", np.array([1, 3], np.int64))])
    return g.node(
        "Where",
        [mask, g.const("zero", np.float32(0.0)), g.const("masked", np.float32(MASKED_SCORE))],
    )


def decoder_layers(
    g, parts, x, self_attention, opset, alignment=False, spread=None, pack=None, attention=None
):
    """The decoder layers over the rows `x` `(rows, d)`; returns the final hidden rows
    (after the final norm, if any), or with `alignment` the cross-attention weights of
    `spec.alignment_layer` averaged over heads, `(sentences, rows per sentence,
    source_len)`, computed no further than that. `attention`, a list, gets those
    weights appended on the way (the layers then go on to the end).

    `self_attention(y, layer, i)` gives a layer's self-attention output `(rows, d)`
    (the cached step's, or the teacher-forced pass's causal one). The
    cross-attention reads `source_mask` and `cross_key_i`, `cross_value_i`
    `(sentences, heads, source_len, head_dim)`: the rows of a sentence (its beams,
    or its target positions) are consecutive and share its keys and values, held
    once per sentence, so a sentence's queries go in as the columns of one
    product with its keys.

    With `spread` and `pack`, `x` holds only some rows of that layout (the
    teacher-forced pass's real target positions): `spread(v)` lays such rows
    out in full (zeros elsewhere) for the cross-attention, `pack(v)` takes
    them back; every row-wise product runs on the packed rows only.
    """
    c = parts.config
    activation = layers_activation(parts.decoder_layers, "decoder graph")
    d, n = c.hidden_dim, c.num_heads
    h = d // n
    bias = source_bias(g)
    merged_rows = g.const("shape_merged_rows", np.array([-1, d], np.int64))
    # (sentences, rows per sentence, heads, head_dim) for the cross-attention queries.
    grouped_heads = g.node(
        "Concat",
        [
            g.node("Shape", ["source_mask"], start=0, end=1),
            g.const("shape_group_heads", np.array([-1, n, h], np.int64)),
        ],
        axis=0,
    )
    last = alignment_layer(len(parts.decoder_layers))

    def dense(y, kernel, bias_, prefix):
        return gemm(g, y, kernel, bias_, prefix)

    def residual(y, sublayer, norm_layer, prefix):
        return residual_block(g, y, sublayer, norm_layer, prefix, c.normalize_first)

    for i, layer in enumerate(parts.decoder_layers):
        p = f"layer_{i}"
        ca, ff = layer.cross_attention, layer.feed_forward
        found = {}

        def cross_attention(y, ca=ca, p=p, i=i, found=found):
            q = dense(y, *scaled_query_weights(ca, d, h), f"{p}.cross_q")
            if spread is not None:
                q = spread(q)
            q = g.node("Reshape", [q, grouped_heads])  # (S, G, N, H)
            columns = g.node("Transpose", [q], perm=[0, 2, 3, 1])  # (S, N, H, G)
            scores = g.node("MatMul", [f"cross_key_{i}", columns])  # (S, N, L, G)
            weights = g.node("Softmax", [g.node("Add", [scores, bias])], axis=2)
            weights = g.node("Transpose", [weights], perm=[0, 1, 3, 2])  # (S, N, G, L)
            found["weights"] = weights
            attended = g.node("MatMul", [weights, f"cross_value_{i}"])  # (S, N, G, H)
            attended = g.node("Transpose", [attended], perm=[0, 2, 1, 3])  # (S, G, N, H)
            attended = g.node("Reshape", [attended, merged_rows])
            if pack is not None:
                attended = pack(attended)
            return dense(attended, *projection_weights(ca.output_dense, d), f"{p}.cross_out")

        def feed_forward(y, ff=ff, p=p):
            inner = dense(
                y,
                weight_array(ff.intermediate_dense.kernel),
                weight_array(ff.intermediate_dense.bias),
                f"{p}.ff_in",
            )
            inner = feed_forward_activation(g, inner, activation)
            return dense(
                inner,
                weight_array(ff.output_dense.kernel),
                weight_array(ff.output_dense.bias),
                f"{p}.ff_out",
            )

        def own_attention(y, layer=layer, i=i):
            return self_attention(y, layer, i)

        x = residual(x, own_attention, layer.self_attention_norm, f"{p}.self_norm")
        x = residual(x, cross_attention, layer.cross_attention_norm, f"{p}.cross_norm")
        if (alignment or attention is not None) and i == last:
            # The mean over heads (axis 1); the axes are an input from opset 18.
            if opset >= 18:
                mean = g.node("ReduceMean", [found["weights"], g.int64s([1])], keepdims=0)
            else:
                mean = g.node("ReduceMean", [found["weights"]], axes=[1], keepdims=0)
            if alignment:
                return mean
            attention.append(mean)
        x = residual(x, feed_forward, layer.feed_forward_norm, f"{p}.ff_norm")

    if parts.decoder_final_norm is not None:
        x = layer_norm(g, x, parts.decoder_final_norm, "final_norm")
    return x


# The node names of a shortlisted step's output product, and of the tied one.
LISTED_OUTPUT = "listed_output"
TIED_OUTPUT = "tied_output"


def output_logits(g, parts, x, shortlist=None):
    """The logits `(rows, vocabulary)` of the hidden rows `x`: the tied embeddings
    (plus the output bias where the model has one) or the output projection.

    With `shortlist` (the name of a `(K,) int64` value of vocabulary ids), the
    logits `(rows, K)` of those ids alone: their rows of the output matrix are
    gathered and transposed (before the loop, in a search graph: `hoisted`),
    then multiplied."""
    if shortlist is not None:
        if parts.output_projection is None:
            table = g.const("embeddings", output_embeddings(parts))
            bias = parts.target_embedding.logits_bias
        else:
            kernel = weight_array(parts.output_projection.kernel)
            table = g.const("output_rows", np.ascontiguousarray(kernel.T))
            bias = parts.output_projection.bias
        rows = g.node("Gather", [table, shortlist], axis=0)  # (K, d)
        # Named: the int8 export quantizes it itself (`quantize.int8_listed_output`).
        logits = g.node("MatMul", [x, g.node("Transpose", [rows], perm=[1, 0])])
        g.nodes[-1].name = LISTED_OUTPUT
        if bias is not None:
            bias = g.const("output_bias", weight_array(bias))
            logits = g.node("Add", [logits, g.node("Gather", [bias, shortlist], axis=0)])
        return logits
    if parts.output_projection is None:
        # The lookups' own table, transposed in the graph (ONNX Runtime folds the
        # `Transpose` of a constant when it loads it): the tied embeddings are
        # stored once (in int8 too: `quantize.int8_tied_output`).
        table = g.const("embeddings", output_embeddings(parts))
        logits = g.node("MatMul", [x, g.node("Transpose", [table], perm=[1, 0])])
        g.nodes[-1].name = TIED_OUTPUT
        if parts.target_embedding.logits_bias is not None:
            bias = weight_array(parts.target_embedding.logits_bias)
            logits = g.node("Add", [logits, g.const("output_bias", bias)])
        return logits
    return gemm(
        g,
        x,
        weight_array(parts.output_projection.kernel),
        weight_array(parts.output_projection.bias),
        "output_projection",
    )


def cache_value(g, name, length, parts, rows="batch"):
    """The value info of a key or value cache `(rows, heads, length, head_dim)`."""
    from onnx import TensorProto

    c = parts.config
    return g.value_info(
        name, TensorProto.FLOAT, [rows, c.num_heads, length, c.hidden_dim // c.num_heads]
    )


def cross_cache_inputs(g, parts):
    """The value infos of `source_mask` and every layer's cross keys and values."""
    from onnx import TensorProto

    inputs = [g.value_info("source_mask", TensorProto.BOOL, ["sentences", "source_len"])]
    for i in range(parts.config.num_decoder_layers):
        inputs += [
            cache_value(g, f"cross_key_{i}", "source_len", parts, rows="sentences"),
            cache_value(g, f"cross_value_{i}", "source_len", parts, rows="sentences"),
        ]
    return inputs


def build_decoder_step(parts, opset=17, shortlist=False):
    """Returns the decoder-step `onnx.ModelProto` for a float32 model's `TransformerParts`.

    With `shortlist`, the step scores only the vocabulary ids of its input
    `shortlist (shortlist,) int64` (ascending, so that ties still go to the
    lower id): `log_probs (batch, shortlist)` is normalized over them, in
    their order, and `top_ids` are vocabulary ids. The search graphs built
    from such a step take the same input (`keras_transformer_runtime.shortlist`).

    Inputs: `token_ids (batch, 1) int32`, `source_mask (sentences,
    source_len) bool`, per layer i `cross_key_i`, `cross_value_i
    (sentences, heads, source_len, head_dim)` (from encoder.onnx) and
    `self_key_i`, `self_value_i (batch, heads, past_len, head_dim)`. The new
    token is at position `past_len`; and `top_k (1,) int64`. `batch` is a
    multiple of `sentences`: rows `s * G .. s * G + G - 1` (G = batch /
    sentences, e.g. the beams) all read sentence s, so a beam search keeps
    one copy of each sentence's cross keys and values, not one per beam.
    Outputs: `log_probs (batch, vocabulary)`; `top_log_probs (batch, top_k)`
    and `top_ids (batch, top_k) int64`, the best `top_k` tokens of each row other than padding and BOS,
    best first (ties: lower id), which is all a search step reads; and
    `new_self_key_i`, `new_self_value_i (batch, heads, past_len + 1, head_dim)`;
    `alignment_weights (batch, source_len) float`, the cross-attention of
    `spec.alignment_layer` averaged over heads (what the search graphs return
    as alignments).
    """
    from onnx import TensorProto

    if opset < 17:
        raise ValueError(f"The decoder step needs opset >= 17 (LayerNormalization). Got {opset}")
    c = parts.config
    d, n = c.hidden_dim, c.num_heads
    h = d // n
    g = GraphBuilder()

    # Embedding of the new token at position past_len (read off the first cache).
    tokens = g.node("Reshape", ["token_ids", g.const("shape_flat", np.array([-1], np.int64))])
    # (1,) int64; a search graph reads its sinusoids off a table (`loop_step.POSITION`)
    position = g.node("Shape", ["self_key_0"], "position", start=2, end=3)
    x, encoding = target_embedding(g, parts, tokens, position)
    x = g.node("Add", [x, encoding])

    qkv_heads = g.const("shape_qkv_heads", np.array([0, 3 * n, 1, h], np.int64))
    three_parts = g.const("split_qkv", np.array([n, n, n], np.int64))
    merged = g.const("shape_merged", np.array([0, d], np.int64))
    outputs = []

    def self_attention(y, layer, i):
        sa, p = layer.self_attention, f"layer_{i}"
        qkv = gemm(g, y, *fused_qkv_weights(sa, d, h), f"{p}.self_qkv")
        # (B, 3D) -> (B, 3N, 1, H): split on the heads axis, each part is
        # already laid out as one new cache position (B, N, 1, H).
        q, k, v = g.node(
            "Split",
            [g.node("Reshape", [qkv, qkv_heads]), three_parts],
            outputs=[f"{p}.q", f"{p}.k", f"{p}.v"],
            axis=1,
        )
        keys = g.node("Concat", [f"self_key_{i}", k], [f"new_self_key_{i}"], axis=2)
        values = g.node("Concat", [f"self_value_{i}", v], [f"new_self_value_{i}"], axis=2)
        outputs.extend([keys, values])
        keys_t = g.node("Transpose", [keys], perm=[0, 1, 3, 2])  # fused into the product
        weights = g.node("Softmax", [g.node("MatMul", [q, keys_t])], axis=-1)  # (B, N, 1, L)
        attended = g.node("Reshape", [g.node("MatMul", [weights, values]), merged])
        return gemm(g, attended, *projection_weights(sa.output_dense, d), f"{p}.self_out")

    attention = []
    x = decoder_layers(g, parts, x, self_attention, opset, attention=attention)
    # Each row's alignment weights, (batch, source_len): its sentence's block of
    # `(sentences, rows per sentence, source_len)`, rows in order.
    rows_by_source = g.node(
        "Concat",
        [g.int64s([-1]), g.node("Shape", ["source_mask"], start=1, end=2)],
        axis=0,
    )
    g.node("Reshape", [attention[0], rows_by_source], [ALIGNMENT_WEIGHTS])
    listed = "shortlist" if shortlist else None
    g.node("LogSoftmax", [output_logits(g, parts, x, listed)], ["log_probs"], axis=-1)
    # The search loops' selection, in the graph: a row's `top_k` best tokens
    # cost less to find here than in numpy, and less to copy out than the row.
    never = np.zeros(c.vocabulary_size, np.float32)
    never[banned_ids()] = -np.inf
    never = g.const("banned_ids_bias", never)
    if shortlist:  # the ban of the listed ids; TopK's positions map back to ids
        never = g.node("Gather", [never, "shortlist"], axis=0)
    allowed = g.node("Add", ["log_probs", never])
    top = "top_at" if shortlist else "top_ids"
    g.node("TopK", [allowed, "top_k"], ["top_log_probs", top], axis=-1)
    if shortlist:
        g.node("Gather", ["shortlist", "top_at"], ["top_ids"], axis=0)

    inputs = [g.value_info("token_ids", TensorProto.INT32, ["batch", 1])]
    inputs += cross_cache_inputs(g, parts)
    for i in range(c.num_decoder_layers):
        inputs += [
            cache_value(g, f"self_key_{i}", "past_len", parts),
            cache_value(g, f"self_value_{i}", "past_len", parts),
        ]
    inputs.append(g.value_info("top_k", TensorProto.INT64, [1]))
    if shortlist:
        inputs.append(g.value_info("shortlist", TensorProto.INT64, ["shortlist"]))
    scored = "shortlist" if shortlist else c.vocabulary_size
    graph_outputs = [
        g.value_info("log_probs", TensorProto.FLOAT, ["batch", scored]),
        g.value_info("top_log_probs", TensorProto.FLOAT, ["batch", "top_k"]),
        g.value_info("top_ids", TensorProto.INT64, ["batch", "top_k"]),
        g.value_info(ALIGNMENT_WEIGHTS, TensorProto.FLOAT, ["batch", "source_len"]),
    ] + [cache_value(g, name, "past_len_plus_1", parts) for name in outputs]
    return g.model("decoder_step", inputs, graph_outputs, opset=opset)


def step_vocabulary_size(step):
    """The vocabulary size of the decoder-step `onnx.ModelProto` `step` (of any
    precision, shortlisted or not, `hoisted` or not): its `vocabulary_size`
    property (`shortlisted.mark_vocabulary_size`), else the length of its ban of padding
    and BOS."""
    props = {p.key: p.value for p in step.metadata_props}
    if "vocabulary_size" in props:
        return int(props["vocabulary_size"])
    (ban,) = [t for t in step.graph.initializer if t.name == "banned_ids_bias"]
    return ban.dims[0]


def selection_block_size(vocabulary_size):
    """The block width of `blocked_selection`: the divisor of the vocabulary size
    between 16 and 512 nearest its square root, or None (no such divisor, or a
    vocabulary too small to gain)."""
    if vocabulary_size < 1024:
        return None
    divisors = [b for b in range(16, 513) if vocabulary_size % b == 0]
    return min(divisors, key=lambda b: abs(b * b - vocabulary_size), default=None)


def selection_top_k_limit(vocabulary_size):
    """The largest `top_k` of a `blocked_selection` step (its number of blocks),
    or None where the step keeps its full `TopK`."""
    block = selection_block_size(vocabulary_size)
    return None if block is None else vocabulary_size // block


def blocked_selection(step):
    """`step` (a decoder-step `onnx.ModelProto`) with its `top_k` selection made
    block by block, for the search graphs; None where the vocabulary has no
    block width (`selection_block_size`): the step as it is then serves.

    The step's selection, an `Add` that bans padding and BOS and a `TopK` over
    every row's log-probabilities, costs about as much as the `LogSoftmax`
    before it at batches of tens of rows. Here one `ReduceMax` pass gives each
    block of `b` tokens its maximum; the `k` blocks with the highest maxima
    (ties to the lower block) hold the row's `k` best tokens, so they are
    gathered in id order and a `TopK` over their `k * b` tokens picks them:
    the tokens, log-probabilities and tie rule (the lower id first) of the full
    `TopK`. The ban touches the first block only (padding and BOS are ids 0
    and 1). `top_k` may be at most the number of blocks,
    `selection_top_k_limit(vocabulary_size)`.
    """
    from onnx import helper

    graph = step.graph
    outputs = {v.name: v for v in graph.output}
    vocabulary_size = outputs["log_probs"].type.tensor_type.shape.dim[1].dim_value
    block = selection_block_size(vocabulary_size)
    if block is None:
        return None
    blocks = vocabulary_size // block
    float_type = outputs["top_log_probs"].type.tensor_type.elem_type
    (select,) = [n for n in graph.node if list(n.output) == ["top_log_probs", "top_ids"]]
    (ban,) = [n for n in graph.node if n.output[0] == select.input[0]]
    if list(ban.input) != ["log_probs", "banned_ids_bias"] or select.input[1] != "top_k":
        raise ValueError("The decoder step's selection is not Add(log_probs, ban) -> TopK.")
    opset = next(o.version for o in step.opset_import if o.domain in ("", "ai.onnx"))
    g = GraphBuilder("best.")
    # The ids the step bans (its `banned_ids_bias`, which may sit in an
    # external weights file), all inside the first block.
    first_block_ban = np.zeros(block, np.float32)
    first_block_ban[banned_ids()] = -np.inf
    first_block_ban = g.const(
        "first_block_ban", first_block_ban, helper.tensor_dtype_to_np_dtype(float_type)
    )
    last_axis, one, block_width = g.int64s([-1]), g.int64s([1]), g.int64s(block)

    def reduce_max(x, out, keepdims):
        # The axes are an input from opset 18, an attribute before.
        if opset >= 18:
            return g.node("ReduceMax", [x, last_axis], out, keepdims=keepdims)
        return g.node("ReduceMax", [x], out, axes=[-1], keepdims=keepdims)

    rows_of_blocks = g.reshape("log_probs", [0, blocks, block], "blocks")  # (B, blocks, block)
    block_max = reduce_max(rows_of_blocks, "block_max", 0)  # (B, blocks)
    first = g.node("Slice", ["log_probs", g.int64s([0]), g.int64s([block]), one], "first")
    first_allowed = g.node("Add", [first, first_block_ban], "first_allowed")
    first_max = reduce_max(first_allowed, "first_max", 1)  # (B, 1)
    other_max = g.node("Slice", [block_max, one, g.int64s([blocks]), one], "other_max")
    allowed_max = g.node("Concat", [first_max, other_max], "allowed_max", axis=1)
    # The k best blocks, then in id order (TopK's ties go to the lower block).
    _, best_blocks = g.node("TopK", [allowed_max, "top_k"], ["best_max", "best_blocks"], axis=1)
    blocks_at, _ = g.node(
        "TopK", [best_blocks, "top_k"], ["blocks_at", "order"], axis=1, largest=0
    )  # (B, k)
    blocks_at_3d = g.unsqueeze(blocks_at, [-1], "blocks_at_3d")  # (B, k, 1)
    row_blocks = g.node(
        "GatherND", [rows_of_blocks, blocks_at_3d], "row_blocks", batch_dims=1
    )  # (B, k, block)
    in_first = g.node("Equal", [blocks_at_3d, g.int64s(0)], "in_first")
    banned = g.node("Add", [row_blocks, first_block_ban], "row_blocks_banned")
    row_allowed = g.node("Where", [in_first, banned, row_blocks], "row_allowed_3d")
    row_allowed = g.reshape(row_allowed, [0, -1], "row_allowed")  # (B, k * block)
    at = g.output("TopK", [row_allowed, "top_k"], ["top_log_probs", g.name("at")], axis=1)[1]
    which = g.node("Div", [at, block_width], "which")
    within = g.node("Mod", [at, block_width], "within")
    chosen = g.node("GatherElements", [blocks_at, which], "chosen", axis=1)
    chosen_start = g.node("Mul", [chosen, block_width], "chosen_start")
    g.output("Add", [chosen_start, within], "top_ids")

    nodes = []
    for node in graph.node:
        if node is select:
            nodes += g.nodes
        elif node is not ban:
            nodes.append(node)
    copy = type(step)()
    copy.CopyFrom(step)
    del copy.graph.node[:]
    copy.graph.node.extend(nodes)
    copy.graph.initializer.extend(g.initializers)
    return copy
