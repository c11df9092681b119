"""ONNX Runtime vs Keras (KV-cached, compiled) on the same trained model, side by side.

Measures, for both engines in one process with repetitions interleaved:
the encoder forward on a batch of sentences, and complete translation of the
same sentences (greedy and beam 4, batch 1 and batch 32; tokenization and
detokenization included, real stopping at EOS). Medians are reported, with
the ratio Keras time / ONNX Runtime time, and how many outputs agree.

    make demo                                    # trains runs/demo (toy corpus)
    python -m benchmarks.onnx_vs_keras           # runs/demo, 200 held-out toy sentences
    python -m benchmarks.onnx_vs_keras --run-dir runs/multi30k-de-en \\
        --lines ../shared/data/multi30k/test_2016_flickr.de.gz

The run is exported to ONNX first (into RUN_DIR/onnx unless it is there).
`--transformer-optimizer` also tries ONNX Runtime's transformer optimizer
(needs sympy) and reports what it fused. Prints a table and writes JSON to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from benchmarks.machine import describe_machine
from keras_transformer.io_utils import atomic_write_json

CASES = [("greedy", 1, 1), ("greedy", 1, 32), ("beam4", 4, 1), ("beam4", 4, 32)]


def held_out_toy_lines(count, seed=12345):
    from keras_transformer.data.toy import generate_toy_corpus

    corpus = generate_toy_corpus(num_train=1, num_valid=1, num_test=count, max_words=8, seed=seed)
    return [source for source, _ in corpus.test]


def transformer_optimizer_report(onnx_dir, config):
    """Runs ONNX Runtime's transformer optimizer on the graphs; returns what it fused."""
    import collections

    import onnx
    from onnxruntime.transformers.optimizer import optimize_model

    report = {}
    for name in ("encoder", "decoder_step"):
        path = os.path.join(onnx_dir, f"{name}.onnx")
        before = collections.Counter(node.op_type for node in onnx.load(path).graph.node)
        optimized = optimize_model(
            path,
            model_type="bert",
            num_heads=config["num_heads"],
            hidden_size=config["hidden_dim"],
            opt_level=0,
        )
        after = collections.Counter(node.op_type for node in optimized.model.graph.node)
        report[name] = {
            "nodes_before": sum(before.values()),
            "nodes_after": sum(after.values()),
            "op_types_changed": {
                op: [before[op], after[op]] for op in before | after if before[op] != after[op]
            },
        }
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", default="runs/demo")
    parser.add_argument("--onnx-dir", help="export folder (default: RUN_DIR/onnx, made if absent)")
    parser.add_argument("--lines", help="source sentences (plain or .gz); default: toy sentences")
    parser.add_argument("--count", type=int, default=200, help="sentences translated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transformer-optimizer", action="store_true")
    parser.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads")
    parser.add_argument("--out", help="JSON path")
    args = parser.parse_args(argv)

    from keras_transformer_runtime import OnnxTranslator

    from keras_transformer.export.onnx import export_onnx, float32_copy
    from keras_transformer.model import transformer_parts
    from keras_transformer.translation import load_run, translate_lines

    onnx_dir = args.onnx_dir or os.path.join(args.run_dir, "onnx")
    model, tokenizer = load_run(args.run_dir)
    # The graphs are float32: compare with the same float32 model in Keras
    # (a run trained in mixed precision is rebuilt, as the export does).
    trained_precision = model.get_layer("decoder_layer_0").dtype_policy.name
    model = float32_copy(model)
    if not os.path.isfile(os.path.join(onnx_dir, "manifest.json")):
        print(f"exporting {args.run_dir} to {onnx_dir}", flush=True)
        export_onnx(args.run_dir, onnx_dir)
    translator = OnnxTranslator(onnx_dir, num_threads=args.threads)
    config = transformer_parts(model).config

    if args.lines:
        from keras_transformer.data.pipeline import read_lines

        lines = read_lines(args.lines)[: args.count]
    else:
        lines = held_out_toy_lines(args.count)

    sources = np.zeros((32, max(len(tokenizer.encode(s)) + 1 for s in lines[:32])), np.int32)
    for i, text in enumerate(lines[:32]):
        ids = tokenizer.encode(text) + [tokenizer.eos_id]
        sources[i, : len(ids)] = ids
    from keras_transformer.keras_decoder import compiled_steps

    keras_encode = compiled_steps(model).encode  # the compiled encoder the Keras search uses

    def keras_encoder():
        np.asarray(keras_encode(sources)[0])

    def onnx_encoder():
        translator.decoder.encode(sources)

    jobs = {("encoder", 0, 32): {"keras": keras_encoder, "onnxruntime": onnx_encoder}}
    outputs = {}
    for name, beam, batch in CASES:

        def keras_job(beam=beam, batch=batch, key=(name, beam, batch)):
            outputs[key, "keras"] = translate_lines(
                model, tokenizer, lines, beam_size=beam, batch_size=batch
            )

        def onnx_job(beam=beam, batch=batch, key=(name, beam, batch)):
            outputs[key, "onnxruntime"] = translator.translate(
                lines, beam_size=beam, batch_size=batch
            )

        jobs[name, beam, batch] = {"keras": keras_job, "onnxruntime": onnx_job}

    print(
        f"{config.num_layers} layers, d_model {config.hidden_dim}, vocabulary "
        f"{config.vocabulary_size}; {len(lines)} sentences; ONNX Runtime on {translator.provider}",
        flush=True,
    )
    for job in jobs.values():  # warm-up: traces, compiles, allocates
        for fn in job.values():
            fn()
    times = {(key, engine): [] for key, job in jobs.items() for engine in job}
    for _ in range(args.repeats):
        for key, job in jobs.items():
            for engine, fn in job.items():  # interleaved
                start = time.perf_counter()
                fn()
                times[key, engine].append(time.perf_counter() - start)

    rows = []
    print(f"{'task':<22} | {'keras s':>9} | {'onnxruntime s':>13} | {'speed-up':>8} | agree")
    for key in jobs:
        keras_s = statistics.median(times[key, "keras"])
        onnx_s = statistics.median(times[key, "onnxruntime"])
        name, beam, batch = key
        agree = None
        if name != "encoder":
            pairs = zip(outputs[key, "keras"], outputs[key, "onnxruntime"], strict=True)
            agree = float(np.mean([a == b for a, b in pairs]))
        task = "encoder (32 sentences)" if name == "encoder" else f"{name} batch {batch}"
        rows.append(
            {
                "task": task,
                "keras_seconds": keras_s,
                "onnxruntime_seconds": onnx_s,
                "speedup": keras_s / onnx_s,
                "sentences": 32 if name == "encoder" else len(lines),
                "same_output_fraction": agree,
                "keras_repeats": times[key, "keras"],
                "onnxruntime_repeats": times[key, "onnxruntime"],
            }
        )
        agreement = "" if agree is None else f"{100 * agree:.1f}%"
        print(
            f"{task:<22} | {keras_s:>9.3f} | {onnx_s:>13.3f} | x{keras_s / onnx_s:>7.2f} | "
            f"{agreement}",
            flush=True,
        )

    result = {
        "machine": describe_machine(),
        "run_dir": args.run_dir,
        "config": config.to_dict(),
        "provider": translator.provider,
        "trained_precision": trained_precision,
        "keras_precision": "float32",
        "settings": vars(args),
        "rows": rows,
    }
    if args.transformer_optimizer:
        result["transformer_optimizer_fusions"] = transformer_optimizer_report(
            onnx_dir, config.to_dict()
        )
        print("transformer optimizer fusions:", result["transformer_optimizer_fusions"])
    name = os.path.basename(os.path.normpath(args.run_dir))
    out = args.out or os.path.join(
        os.path.dirname(__file__), "results", f"onnx_vs_keras-{name}.json"
    )
    atomic_write_json(out, result)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
