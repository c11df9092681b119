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


def int8_graph(path, out_path, vocabulary_size, nodes_to_exclude=()):
    """Dynamic int8 quantization of the constant-weight MatMul and Gemm of a float32 graph,
    and int8 embedding tables (`int8_embeddings`).

    One scale per weight matrix: on the Multi30k `small` model one scale per
    output column gave the same test BLEU (greedy and beam 5 within 0.12) but
    made a batch-1 decoder step about an eighth slower
    (benchmarks/README.md, the int8 paragraph).
    """
    import logging

    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from keras_transformer.startup import DropMessages

    source = tied_kernel_constant(onnx.load(path)) or path

    # The quantizer advises, on the root logger and once per graph, an optional
    # pre-processing pass; the int8 graphs are judged by their translations
    # instead (tests/export/test_onnx.py, benchmarks.onnx_vs_ctranslate2).
    hush = DropMessages("pre-processing before quantization")
    logging.getLogger().addFilter(hush)
    try:
        quantize_dynamic(
            source,
            out_path,
            op_types_to_quantize=["MatMul", "Gemm"],
            per_channel=False,
            weight_type=QuantType.QInt8,
            extra_options={"MatMulConstBOnly": True},
            nodes_to_exclude=list(nodes_to_exclude),
        )
    finally:
        logging.getLogger().removeFilter(hush)
    model = onnx.load(out_path)
    if int8_embeddings(model.graph, vocabulary_size):
        onnx.save(model, out_path)


def int8_embeddings(graph, vocabulary_size):
    """Stores the float32 `(vocabulary, width)` tables that `Gather` reads as int8
    with one scale per row (symmetric, the row's largest magnitude at 127): the
    gathered rows are dequantized, `Cast(int8 rows) * row scales`. The
    quantizer leaves `Gather` tables in float32, and the embedding table was
    then half of an int8 export. Returns whether any table was replaced.
    """
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    tables = {
        t.name: t
        for t in graph.initializer
        if t.data_type == TensorProto.FLOAT and len(t.dims) == 2 and t.dims[0] == vocabulary_size
    }
    nodes, replaced = [], set()
    for node in graph.node:
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if node.op_type != "Gather" or node.input[0] not in tables or axis != 0:
            nodes.append(node)
            continue
        name, ids, out = node.input[0], node.input[1], node.output[0]
        if name not in replaced:
            table = numpy_helper.to_array(tables[name]).astype(np.float32)
            scale = np.abs(table).max(axis=1, keepdims=True) / 127.0
            scale[scale == 0] = 1.0
            quantized = np.clip(np.round(table / scale), -127, 127).astype(np.int8)
            graph.initializer.append(numpy_helper.from_array(quantized, f"{name}_int8"))
            graph.initializer.append(
                numpy_helper.from_array(scale.astype(np.float32), f"{name}_scale")
            )
            replaced.add(name)
        nodes += [
            helper.make_node("Gather", [f"{name}_int8", ids], [f"{out}_int8"]),
            helper.make_node("Cast", [f"{out}_int8"], [f"{out}_dequantized"], to=TensorProto.FLOAT),
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


def tied_kernel_constant(model):
    """`model` with the tied output product's `B`, a `Transpose` of the lookups'
    float32 table (`step_graph.TIED_OUTPUT`), made a constant of its own, so
    that the quantizer quantizes it like any other weight: one scale for the
    whole matrix, in the product's layout. Returns None when there is none.

    The int8 graph thus holds the table twice (the lookups' copy has one scale
    per row). A single int8 copy, the product reading the row-scaled table
    through a folded `Transpose`, made the output product slower: ONNX Runtime's
    int8 product with one scale per output column is 0.65x one scale at batch
    1 and 0.9x at batch 32 (docs/performance.md, "The tied table in int8").
    """
    from onnx import numpy_helper

    from keras_transformer.export.step_graph import TIED_OUTPUT

    graph = model.graph
    made = {out: node for node in graph.node for out in node.output}
    found = [n for n in graph.node if n.name == TIED_OUTPUT and n.op_type == "MatMul"]
    transpose = made.get(found[0].input[1]) if len(found) == 1 else None
    tables = {t.name: t for t in graph.initializer}
    if transpose is None or transpose.op_type != "Transpose" or transpose.input[0] not in tables:
        return None
    kernel = numpy_helper.to_array(tables[transpose.input[0]]).T.copy()
    name = f"{found[0].output[0]}_kernel"
    graph.initializer.append(numpy_helper.from_array(kernel, name))
    found[0].input[1] = name
    if not any(transpose.output[0] in n.input for n in graph.node):
        graph.node.remove(transpose)
    return model


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
    one scale per listed row), instead of dequantized rows in a float32
    `MatMul`. Returns whether it was replaced."""
    from onnx import TensorProto, helper

    from keras_transformer.export.step_graph import LISTED_OUTPUT

    graph = model.graph
    made = {out: node for node in graph.node for out in node.output}
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
    if rows is None or rows.op_type != "Gather" or scale is None or scale.op_type != "Gather":
        return False
    out = product.output[0]
    graph.initializer.append(helper.make_tensor(f"{out}_scale_shape", TensorProto.INT64, [1], [-1]))
    nodes = [
        helper.make_node("Transpose", [rows.output[0]], [f"{out}_rows_t"], perm=[1, 0]),
        helper.make_node("Reshape", [scale.output[0], f"{out}_scale_shape"], [f"{out}_scales"]),
        helper.make_node(
            "DynamicQuantizeMatMul",
            [product.input[0], f"{out}_rows_t", f"{out}_scales"],
            [out],
            name=LISTED_OUTPUT,
            domain="com.microsoft",
        ),
    ]
    at = list(graph.node).index(product)
    graph.node.remove(product)
    for i, node in enumerate(nodes):
        graph.node.insert(at + i, node)
    for node in (transpose, mul, cast):  # the float32 rows, now unread
        if not any(node.output[0] in n.input for n in graph.node):
            graph.node.remove(node)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return True
