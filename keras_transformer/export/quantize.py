"""The float16 and int8 versions of an export's float32 graphs.

`float16_graph` is ONNX Runtime's float16 conversion with float32 inputs and
outputs; `int8_graph` is its dynamic quantization of the constant-weight
MatMul and Gemm, and int8 embedding tables. Needs onnx and onnxruntime.
"""

from __future__ import annotations

from keras_transformer.export.weights import ExportError


def float16_graph(proto):
    from onnxruntime.transformers.float16 import convert_float_to_float16

    half = convert_float_to_float16(proto, keep_io_types=True, disable_shape_infer=False)
    sort_topologically(half.graph)  # the converter appends its input casts at the end
    return half


def int8_graph(path, out_path, vocabulary_size, nodes_to_exclude=(), shared_table=None):
    """Dynamic int8 quantization of the constant-weight MatMul and Gemm of a float32 graph,
    and int8 embedding tables (`int8_embeddings`).

    One scale per weight matrix: on the Multi30k `small` model one scale per
    output column gave the same test BLEU (greedy and beam 5 within 0.12) but
    made a batch-1 decoder step about an eighth slower
    (benchmarks/README.md, the int8 paragraph).

    `shared_table`: the float32 `(vocabulary, d)` table that the lookups and the
    tied output product share (None where the output layer has a matrix of its
    own). Every graph stores it once, in int8 with one scale for the whole
    table: the lookups dequantize its rows, the product reads it transposed
    (`int8_tied_output`).
    """
    import logging

    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from keras_transformer.export.step_graph import TIED_OUTPUT
    from keras_transformer.startup import DropMessages

    excluded = list(nodes_to_exclude) + ([TIED_OUTPUT] if shared_table is not None else [])
    # The quantizer advises, on the root logger and once per graph, an optional
    # pre-processing pass; the int8 graphs are judged by their translations
    # instead (tests/export/test_onnx.py, benchmarks.onnx_vs_ctranslate2).
    hush = DropMessages("pre-processing before quantization")
    logging.getLogger().addFilter(hush)
    try:
        quantize_dynamic(
            path,
            out_path,
            op_types_to_quantize=["MatMul", "Gemm"],
            per_channel=False,
            weight_type=QuantType.QInt8,
            extra_options={"MatMulConstBOnly": True},
            nodes_to_exclude=excluded,
        )
    finally:
        logging.getLogger().removeFilter(hush)
    model = onnx.load(out_path)
    changed = int8_embeddings(model.graph, vocabulary_size, shared_table)
    if int8_tied_output(model) or changed:
        onnx.save(model, out_path)


def int8_embeddings(graph, vocabulary_size, shared_table=None):
    """Stores the float32 `(vocabulary, width)` tables that `Gather` reads as int8
    (symmetric, the largest magnitude at 127): the gathered rows are
    dequantized, `Cast(int8 rows) * scale`. One scale per row, but one for the
    whole of `shared_table` (a table equal to it), which the tied output product
    reads too (`int8_tied_output`). The quantizer leaves `Gather` tables in
    float32, and the embedding table was then half of an int8 export. Returns
    whether any table was replaced.
    """
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    tables = {
        t.name: t
        for t in graph.initializer
        if t.data_type == TensorProto.FLOAT and len(t.dims) == 2 and t.dims[0] == vocabulary_size
    }
    nodes, replaced, whole = [], set(), set()
    for node in graph.node:
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if node.op_type != "Gather" or node.input[0] not in tables or axis != 0:
            nodes.append(node)
            continue
        name, ids, out = node.input[0], node.input[1], node.output[0]
        if name not in replaced:
            table = numpy_helper.to_array(tables[name]).astype(np.float32)
            if shared_table is not None and np.array_equal(table, shared_table):
                scale = np.float32(np.abs(table).max() / 127.0) or np.float32(1.0)
                whole.add(name)
            else:
                scale = np.abs(table).max(axis=1, keepdims=True) / 127.0
                scale[scale == 0] = 1.0
            quantized = np.clip(np.round(table / scale), -127, 127).astype(np.int8)
            graph.initializer.append(numpy_helper.from_array(quantized, f"{name}_int8"))
            graph.initializer.append(
                numpy_helper.from_array(np.asarray(scale, np.float32), f"{name}_scale")
            )
            replaced.add(name)
        nodes += [
            helper.make_node("Gather", [f"{name}_int8", ids], [f"{out}_int8"]),
            helper.make_node("Cast", [f"{out}_int8"], [f"{out}_dequantized"], to=TensorProto.FLOAT),
        ]
        if name in whole:
            nodes.append(helper.make_node("Mul", [f"{out}_dequantized", f"{name}_scale"], [out]))
        else:
            nodes += [
                helper.make_node("Gather", [f"{name}_scale", ids], [f"{out}_scale"]),
                helper.make_node("Mul", [f"{out}_dequantized", f"{out}_scale"], [out]),
            ]
    if not replaced:
        return False
    still_read = {name for node in nodes for name in node.input}
    kept = [t for t in graph.initializer if t.name not in replaced or t.name in still_read]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    del graph.node[:]
    graph.node.extend(nodes)
    return True


def int8_tied_output(model):
    """The tied output product (`step_graph.TIED_OUTPUT`: the hidden rows by a
    `Transpose` of the lookups' float32 table), left in float32 by the quantizer,
    made to read the int8 table that `int8_embeddings` made of that table with
    one scale: `com.microsoft.DynamicQuantizeMatMul` of the rows by the int8
    table's `Transpose`, which ONNX Runtime folds at load. The table is then
    stored once. Returns whether it was replaced.

    One scale per row would have served too, as one per output column of the
    product, but ONNX Runtime's int8 product with column scales is 0.65x one
    scale at batch 1 and 0.9x at batch 32 (docs/performance.md, "The tied
    table in int8")."""
    from onnx import helper

    from keras_transformer.export.step_graph import TIED_OUTPUT

    graph = model.graph
    made = {out: node for node in graph.node for out in node.output}
    found = [n for n in graph.node if n.name == TIED_OUTPUT and n.op_type == "MatMul"]
    transpose = made.get(found[0].input[1]) if len(found) == 1 else None
    tables = {t.name: t for t in graph.initializer}
    if transpose is None or transpose.op_type != "Transpose":
        return False
    table = transpose.input[0]
    scale = tables.get(f"{table}_scale")
    if f"{table}_int8" not in tables or scale is None or len(scale.dims) != 0:
        return False
    (product,) = found
    out = product.output[0]
    transposed = helper.make_node("Transpose", [f"{table}_int8"], [f"{out}_int8_t"], perm=[1, 0])
    _int8_product(model, product, [transposed], f"{out}_int8_t", f"{table}_scale", [transpose])
    if not any(table in n.input for n in graph.node):  # the float32 table, now unread
        graph.initializer.remove(tables[table])
    return True


def sort_topologically(graph):
    """Reorders `graph.node` so that every node comes after the producers of its inputs."""
    available = {""} | {v.name for v in graph.input} | {t.name for t in graph.initializer}
    pending = list(graph.node)
    ordered = []
    while pending:
        remaining = []
        for node in pending:
            if all(name in available for name in node.input):
                ordered.append(node)
                available.update(node.output)
            else:
                remaining.append(node)
        if len(remaining) == len(pending):
            missing = sorted({n for node in remaining for n in node.input} - available)
            raise ExportError(f"The float16 graph has inputs nothing produces: {missing[:5]}")
        pending = remaining
    copies = [type(node)() for node in ordered]
    for copy, node in zip(copies, ordered, strict=True):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(copies)


def int8_listed_output(model):
    """The output layer of an int8 shortlisted decoder step in int8: the listed
    rows of the int8 embedding table (`int8_embeddings`), transposed, multiplied
    by the dynamically quantized hidden rows (`com.microsoft.DynamicQuantizeMatMul`,
    the table's scale, or one per listed row), instead of dequantized rows in a
    float32 `MatMul`. Returns whether it was replaced."""
    from onnx import TensorProto, helper

    from keras_transformer.export.step_graph import LISTED_OUTPUT

    graph = model.graph
    made = {out: node for node in graph.node for out in node.output}
    scalars = {t.name for t in graph.initializer if len(t.dims) == 0}
    found = [n for n in graph.node if n.name == LISTED_OUTPUT and n.op_type == "MatMul"]
    if not found:
        return False
    (product,) = found
    transpose = made.get(product.input[1])
    mul = made.get(transpose.input[0]) if transpose is not None else None
    if mul is None or mul.op_type != "Mul":
        return False
    cast, scale = made.get(mul.input[0]), made.get(mul.input[1])
    rows = made.get(cast.input[0]) if cast is not None and cast.op_type == "Cast" else None
    whole = mul.input[1] in scalars  # the shared table's one scale (`int8_embeddings`)
    if rows is None or rows.op_type != "Gather" or not (whole or _is_gather(scale)):
        return False
    out = product.output[0]
    nodes = [helper.make_node("Transpose", [rows.output[0]], [f"{out}_rows_t"], perm=[1, 0])]
    scales = mul.input[1]
    if not whole:  # one per listed row: a column of the product each
        shape = helper.make_tensor(f"{out}_scale_shape", TensorProto.INT64, [1], [-1])
        graph.initializer.append(shape)
        scales = f"{out}_scales"
        nodes.append(helper.make_node("Reshape", [scale.output[0], shape.name], [scales]))
    _int8_product(model, product, nodes, f"{out}_rows_t", scales, [transpose, mul, cast])
    return True


def _int8_product(model, product, before, int8_matrix, scales, unread):
    """Replaces the float32 `MatMul` node `product` by the nodes `before` and a
    `com.microsoft.DynamicQuantizeMatMul` of its rows by `int8_matrix` with
    `scales`, under the product's name; then removes the nodes of `unread`
    (in order) whose outputs nothing reads any more."""
    from onnx import helper

    graph = model.graph
    nodes = before + [
        helper.make_node(
            "DynamicQuantizeMatMul",
            [product.input[0], int8_matrix, scales],
            [product.output[0]],
            name=product.name,
            domain="com.microsoft",
        )
    ]
    at = list(graph.node).index(product)
    graph.node.remove(product)
    for i, node in enumerate(nodes):
        graph.node.insert(at + i, node)
    for node in unread:
        if not any(node.output[0] in n.input for n in graph.node):
            graph.node.remove(node)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))


def _is_gather(node):
    return node is not None and node.op_type == "Gather"
