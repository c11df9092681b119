"""What a search step costs as its rows grow, inside ONNX Runtime, one thread.

    python -m benchmarks.search_rows ONNX_DIR --src test.de.gz [--precision int8]

Two measurements, each the best of `--repeats` interleaved passes:

- steps: each of the first `--lines` sentences alone, searched by the
  export's greedy_search graph with 1 row, with `--rows` copies of the
  sentence (the same steps, the decoder computing that many rows), and by
  its beam_search graph with beam `--rows`; microseconds per loop iteration
  of each. The difference between the first two is the decoder's cost of
  the extra rows, between the last two the beam rules' and the cache
  reordering's;
- products: the output projection (hidden size x vocabulary, the largest
  product of a step) as a one-node graph, at 1, 4, 8 and 32 rows, in
  float32 and as ONNX Runtime's dynamic int8 quantization makes it (int8
  weights one scale, as the export's; uint8 weights; int8 with one scale
  per column); microseconds per call;
- decoder products: every other product of a decoder step (per layer the
  self-attention's fused query/key/value and output, the cross-attention's
  query and output, the two feed-forward ones), chained in one graph, in
  float32 and int8 as exported, at 1, 4, 8 and 32 rows; microseconds per call.

With `--profile`, also ONNX Runtime's own profile of the three searches and
of `greedy_batch_search` on batches of `--batch` sentences: microseconds per
loop iteration spent in each operator type. The profiler adds 2-3 us of its
own to every node, so small nodes read high; compare a type across cases.

Writes JSON to benchmarks/results/search_rows.json (or --out).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.search_rows")
    parser.add_argument("onnx_dir", help="a folder written by `keras-transformer export`")
    parser.add_argument("--src", required=True, help="source sentences (plain or .gz)")
    parser.add_argument("--lines", type=int, default=48, help="first N sentences (default 48)")
    parser.add_argument("--precision", default="int8", help="the graphs' precision (default int8)")
    parser.add_argument("--rows", type=int, default=4, help="rows, and beam size (default 4)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved passes (default 7)")
    parser.add_argument("--profile", action="store_true", help="also profile by operator type")
    parser.add_argument("--batch", type=int, default=32, help="--profile's batch (default 32)")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "search_rows.json"))
    return parser


def _best(functions, repeats):
    """The best time of each function over `repeats` interleaved passes."""
    best = {name: float("inf") for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            start = time.perf_counter()
            function()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _search_feeds(translator, source_rows, beam):
    """The search graphs' feeds for `source_rows` (token ids), greedy or beam `beam`."""
    import numpy as np

    source, limits = translator._prepare(source_rows, None)
    _, mask, cross = translator.encode(source)
    feeds = translator._search_feeds(mask, cross)
    feeds["limits"] = np.asarray(limits, np.int64)
    if beam > 1:
        feeds["beam_size"] = np.array(beam, np.int64)
        feeds["length_penalty"] = np.array(0.6, np.float64)
    return feeds


def step_costs(translator, sources, rows, repeats):

    def feeds(source_rows, beam):
        return _search_feeds(translator, source_rows, beam)

    greedy, beam = translator.session("greedy_search"), translator.session("beam_search")
    cases = {
        "greedy, 1 row": (greedy, [feeds([s], 1) for s in sources]),
        f"greedy, {rows} copies": (greedy, [feeds([s] * rows, 1) for s in sources]),
        f"beam {rows}": (beam, [feeds([s], rows) for s in sources]),
    }
    steps = {}
    for name, (session, all_feeds) in cases.items():
        outputs = [session.run(None, f)[0] for f in all_feeds]
        # greedy: tokens (steps, sentences); beam: tokens (sentences, steps)
        axis = 0 if name.startswith("greedy") else 1
        steps[name] = sum(o.shape[axis] for o in outputs)

    def runner(session, all_feeds):
        return lambda: [session.run(None, f) for f in all_feeds]

    best = _best({name: runner(*case) for name, case in cases.items()}, repeats)
    return [
        {
            "case": name,
            "iterations": steps[name],
            "seconds": best[name],
            "microseconds_per_iteration": 1e6 * best[name] / steps[name],
        }
        for name in cases
    ]


def product_costs(hidden, vocabulary, repeats):
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import QuantType, quantize_dynamic

    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((hidden, vocabulary)) * 0.05).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "projection",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", vocabulary])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sessions = {}
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "float32.onnx")
        onnx.save(model, path)
        paths = {"float32": path}
        for name, weight_type, per_channel in (
            ("int8", QuantType.QInt8, False),
            ("uint8", QuantType.QUInt8, False),
            ("int8 per column", QuantType.QInt8, True),
        ):
            paths[name] = os.path.join(folder, f"{len(paths)}.onnx")
            quantize_dynamic(
                path,
                paths[name],
                weight_type=weight_type,
                per_channel=per_channel,
                extra_options={"MatMulConstBOnly": True},
            )
        for name, p in paths.items():
            sessions[name] = ort.InferenceSession(p, options, providers=["CPUExecutionProvider"])
    return _per_call(sessions, hidden, repeats, rng)


def _per_call(sessions, width, repeats, rng, rows_list=(1, 4, 8, 32), calls=50):
    """Microseconds per call of each one-input (`x`, rows x `width`) session, the
    best of `repeats` interleaved passes, at each row count."""
    import numpy as np

    cells = []
    for rows in rows_list:
        x = rng.standard_normal((rows, width)).astype(np.float32)

        def runner(session, x=x):
            return lambda: [session.run(None, {"x": x}) for _ in range(calls)]

        best = _best({name: runner(s) for name, s in sessions.items()}, repeats)
        cells += [
            {"rows": rows, "kind": name, "microseconds_per_call": 1e6 * best[name] / calls}
            for name in sessions
        ]
    return cells


def _quantized_sessions(model):
    """ONNX Runtime sessions (one thread) of `model` in float32 and int8 as exported."""
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    with tempfile.TemporaryDirectory() as folder:
        paths = {"float32": os.path.join(folder, "float32.onnx")}
        onnx.save(model, paths["float32"])
        paths["int8"] = os.path.join(folder, "int8.onnx")
        quantize_dynamic(
            paths["float32"],
            paths["int8"],
            weight_type=QuantType.QInt8,
            extra_options={"MatMulConstBOnly": True},
        )
        return {
            name: ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            for name, path in paths.items()
        }


def decoder_products(config, repeats):
    """Every product of a decoder step but the output projection, chained, per call."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    d, ff = config["hidden_dim"], config["intermediate_dim"]
    rng = np.random.default_rng(0)
    shapes = [(d, 3 * d), (d, d), (d, d), (d, d), (d, ff)]
    nodes, weights, x = [], [], "x"
    for layer in range(config["num_layers"]):
        # Each product reads the layer's input, as the step's do; the last
        # feed-forward product reads the first's output and feeds the next layer.
        for j, (rows_in, cols) in enumerate(shapes + [(ff, d)]):
            w = f"w{layer}_{j}"
            weights.append(
                numpy_helper.from_array(
                    (rng.standard_normal((rows_in, cols)) * 0.05).astype(np.float32), w
                )
            )
            nodes.append(
                helper.make_node("MatMul", [f"p{layer}_4" if j == 5 else x, w], [f"p{layer}_{j}"])
            )
        x = f"p{layer}_5"
    outputs = [f"p{layer}_{j}" for layer in range(config["num_layers"]) for j in range(5)] + [x]
    graph = helper.make_graph(
        nodes,
        "decoder_products",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", d])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    sessions = _quantized_sessions(model)
    cells = _per_call(sessions, d, repeats, rng)
    return [dict(cell, products=len(nodes)) for cell in cells]


def operator_profiles(translator, sources, rows, batch):
    """Microseconds per loop iteration in each operator type, from ONNX Runtime's
    profiler, for the three searches of `step_costs` and `greedy_batch_search`."""
    import collections
    import json

    import onnxruntime as ort

    def feeds(source_rows, beam):
        return _search_feeds(translator, source_rows, beam)

    cases = {
        "greedy, 1 row": ("greedy_search", [feeds([s], 1) for s in sources]),
        f"greedy, {rows} copies": ("greedy_search", [feeds([s] * rows, 1) for s in sources]),
        f"beam {rows}": ("beam_search", [feeds([s], rows) for s in sources]),
    }
    if "greedy_batch_search" in translator._graph_files:
        batches = [sources[i : i + batch] for i in range(0, len(sources), batch)]
        cases[f"greedy batch graph, {batch} sentences"] = (
            "greedy_batch_search",
            [feeds(b, 1) for b in batches],
        )
    profiles = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, (graph, all_feeds) in cases.items():
            options = ort.SessionOptions()
            options.intra_op_num_threads = 1
            options.enable_profiling = True
            options.profile_file_prefix = os.path.join(folder, "profile")
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            path = os.path.join(translator.onnx_dir, translator._graph_files[graph])
            session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            axis = 0 if graph.startswith("greedy") else 1
            iterations = sum(session.run(None, f)[0].shape[axis] for f in all_feeds)
            with open(session.end_profiling()) as f:
                events = json.load(f)
            spent, count = collections.Counter(), collections.Counter()
            for event in events:
                if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
                    spent[event["args"]["op_name"]] += event["dur"]
                    count[event["args"]["op_name"]] += 1
            profiles[name] = {
                "iterations": iterations,
                "operators": {
                    op: {
                        "microseconds_per_iteration": spent[op] / iterations,
                        "nodes_per_iteration": count[op] / iterations,
                    }
                    for op, _ in spent.most_common()
                },
            }
    return profiles


def run(args):
    import logging

    from keras_transformer_runtime import OnnxTranslator

    from benchmarks.machine import write_report
    from keras_transformer.data.pipeline import read_lines
    from keras_transformer.startup import DropMessages

    if args.rows < 2:
        raise SystemExit(f"--rows must be at least 2, not {args.rows}.")
    translator = OnnxTranslator(
        args.onnx_dir,
        providers=["CPUExecutionProvider"],
        num_threads=1,
        precision=args.precision,
        spinning=False,
    )
    sources = [translator.tokenizer.encode(line) for line in read_lines(args.src)[: args.lines]]
    steps = step_costs(translator, sources, args.rows, args.repeats)
    for cell in steps:
        print(f"{cell['case']}: {cell['microseconds_per_iteration']:.1f} us per iteration")
    hush = DropMessages("pre-processing before quantization")
    logging.getLogger().addFilter(hush)
    try:
        products = product_costs(
            translator.manifest["config"]["hidden_dim"],
            translator.vocabulary_size,
            args.repeats,
        )
        layers = decoder_products(translator.manifest["config"], args.repeats)
    finally:
        logging.getLogger().removeFilter(hush)
    for cell in products:
        print(
            f"output projection, {cell['kind']}, {cell['rows']} rows: "
            f"{cell['microseconds_per_call']:.1f} us"
        )
    for cell in layers:
        print(
            f"decoder's other {cell['products']} products, {cell['kind']}, {cell['rows']} rows: "
            f"{cell['microseconds_per_call']:.1f} us"
        )
    extra = {}
    if args.profile:
        extra["profiles"] = operator_profiles(translator, sources, args.rows, args.batch)
        for case, profile in extra["profiles"].items():
            top = list(profile["operators"].items())[:8]
            print(
                f"profile, {case}, us per iteration: "
                + ", ".join(f"{op} {v['microseconds_per_iteration']:.0f}" for op, v in top)
            )
    return write_report(
        "search_rows", args, steps=steps, products=products, decoder_products=layers, **extra
    )


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    main()
