"""A vocabulary shortlist's worth: speed and BLEU of one export's search with it and without.

    python -m benchmarks.shortlist ONNX_DIR [--data DIR] [--splits val test_2016_flickr]
        [--precisions float32 int8] [--beams 1 4] [--batches 32] [--threads 1 2]
        [--parallel 1] [--repeats 3] [--lines N] [--ctranslate2 RUN] [--out JSON]

ONNX_DIR is an export made with `keras-transformer export --shortlist-data`.
Per precision, thread count, beam and batch size, the same translator
settings run with the shortlist (`OnnxTranslator(..., shortlist=None)`, the
default) and without it (`shortlist=False`), their repetitions interleaved;
the fastest repetition of each counts. Each pass gets a translator of its
own, warmed on one batch, and no other of ours is alive while it runs. Lower-cased BLEU (sacreBLEU) of each
split, sentences/s and target tokens/s (the pieces produced, EOS excluded),
the average list size per batch, and the share of identical translations.
Choose the list's settings on val; report test_2016_flickr.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import os
import time

from benchmarks.machine import SHARED_MULTI30K, write_report

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def read(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def run(translator, sources, beam, batch, parallel=1):
    """`(translations, seconds, target pieces)` of one pass over `sources`."""
    from keras_transformer_runtime.options import SearchOptions

    start = time.perf_counter()
    if hasattr(translator, "decoder"):  # ours
        options = SearchOptions(beam_size=beam)
        found = translator.translate_hypotheses(
            sources, options, batch_size=batch, parallel_batches=parallel
        )
        texts = [h[0]["text"] for h in found]
    else:  # CTranslate2 (same batches: sorted by length; length penalty 0.6 in beam search)
        texts = translator.translate(
            sources, beam_size=beam, batch_size=batch, parallel_batches=parallel
        )
    seconds = time.perf_counter() - start
    pieces = sum(len(translator.tokenizer.encode_target(t)) for t in texts)
    return texts, seconds, pieces


def ctranslate2_peers(args, precision, threads, shortlist, folder):
    """CTranslate2 on the run's own weights (`--ctranslate2 RUN`), without and with
    the shortlist as its vocabulary map, each in a process of its own."""
    from benchmarks.ctranslate2_peer import CTranslate2Translator, ctranslate2_model, vmap_file
    from keras_transformer.translation import load_run

    model, tokenizer = load_run(args.ctranslate2)
    quantization = "int8" if precision == "int8" else None
    out = os.path.join(folder, precision)
    vmap = vmap_file(shortlist, tokenizer, os.path.join(folder, "vmap.txt"))
    ctranslate2_model(model, tokenizer, out, quantization, vmap=vmap)
    settings = dict(
        compute_type=precision, threads=threads, parallel_batches=args.parallel, isolated=True
    )
    return {
        "ctranslate2": CTranslate2Translator(out, tokenizer, **settings),
        "ctranslate2_vmap": CTranslate2Translator(out, tokenizer, use_vmap=True, **settings),
    }


def measure(args):
    import tempfile

    import numpy as np
    import sacrebleu
    from keras_transformer_runtime import OnnxTranslator

    data = {}
    for split in args.splits:
        sources = read(os.path.join(args.data, f"{split}.{args.src}.gz"))
        references = read(os.path.join(args.data, f"{split}.{args.tgt}.gz"))
        data[split] = (sources[: args.lines], references[: args.lines])
    rows = []
    for precision in args.precisions:
        for threads in args.threads:
            # Ours are made afresh for every pass, so that no other translator's
            # idle threads spin beside the one timed (ONNX Runtime's threads
            # spin between runs on more than one thread).
            translators = {
                "shortlist": lambda t=threads, p=precision: OnnxTranslator(
                    args.onnx_dir, num_threads=t, precision=p
                ),
                "full": lambda t=threads, p=precision: OnnxTranslator(
                    args.onnx_dir, num_threads=t, precision=p, shortlist=False
                ),
            }
            listed = translators["shortlist"]().decoder  # never searches
            if listed.shortlist is None:
                raise SystemExit(f"{args.onnx_dir} was exported without a shortlist.")
            if args.ctranslate2:
                folder = tempfile.mkdtemp(prefix="ct2-vmap-")
                translators |= ctranslate2_peers(args, precision, threads, listed.shortlist, folder)
            for beam in args.beams:
                for batch in args.batches:
                    for split, (sources, references) in data.items():
                        best, texts = {}, {}
                        for _ in range(args.repeats):
                            for name, translator in translators.items():
                                fresh = not hasattr(translator, "translate")
                                if fresh:
                                    translator = translator()
                                    run(translator, sources[:batch], beam, batch, args.parallel)
                                out, seconds, pieces = run(
                                    translator, sources, beam, batch, args.parallel
                                )
                                if fresh:
                                    del translator
                                    gc.collect()
                                texts[name] = out
                                if seconds < best.get(name, (np.inf,))[0]:
                                    best[name] = (seconds, pieces)
                        sizes = [
                            listed.shortlist.ids(_batch_ids(listed, sources[i : i + batch])).size
                            for i in range(0, len(sources), batch)
                        ]
                        row = {
                            "precision": precision,
                            "threads": threads,
                            "parallel_batches": args.parallel,
                            "beam": beam,
                            "batch": batch,
                            "split": split,
                            "sentences": len(sources),
                            "mean_list_size": float(np.mean(sizes)),
                            "vocabulary_size": listed.vocabulary_size,
                            "same_translations": float(
                                np.mean(
                                    [
                                        a == b
                                        for a, b in zip(
                                            texts["full"], texts["shortlist"], strict=True
                                        )
                                    ]
                                )
                            ),
                        }
                        for name, (seconds, pieces) in best.items():
                            hypotheses = [t.lower() for t in texts[name]]
                            bleu = sacrebleu.corpus_bleu(
                                hypotheses, [[r.lower() for r in references]]
                            )
                            row[name] = {
                                "bleu": round(bleu.score, 2),
                                "seconds": seconds,
                                "sentences_per_second": len(sources) / seconds,
                                "target_tokens_per_second": pieces / seconds,
                            }
                        row["speedup"] = row["full"]["seconds"] / row["shortlist"]["seconds"]
                        if args.ctranslate2:  # > 1: ours is faster
                            row["ours_over_ctranslate2"] = (
                                row["ctranslate2"]["seconds"] / row["full"]["seconds"]
                            )
                            row["ours_shortlist_over_ctranslate2_vmap"] = (
                                row["ctranslate2_vmap"]["seconds"] / row["shortlist"]["seconds"]
                            )
                        rows.append(row)
                        if args.ctranslate2:
                            print(
                                f"  ctranslate2 {row['ctranslate2']['sentences_per_second']:.1f}/s "
                                f"BLEU {row['ctranslate2']['bleu']:.2f}, with vmap "
                                f"{row['ctranslate2_vmap']['sentences_per_second']:.1f}/s BLEU "
                                f"{row['ctranslate2_vmap']['bleu']:.2f}; ours / theirs "
                                f"{row['ours_over_ctranslate2']:.2f}x, with lists "
                                f"{row['ours_shortlist_over_ctranslate2_vmap']:.2f}x",
                                flush=True,
                            )
                        print(
                            f"{precision:7s} {args.parallel}x{threads}t beam {beam} batch {batch:3d} {split:16s} "
                            f"list {row['mean_list_size']:6.0f}/{listed.vocabulary_size} "
                            f"full {row['full']['sentences_per_second']:7.1f}/s "
                            f"BLEU {row['full']['bleu']:5.2f} | shortlist "
                            f"{row['shortlist']['sentences_per_second']:7.1f}/s "
                            f"BLEU {row['shortlist']['bleu']:5.2f} | {row['speedup']:.2f}x",
                            flush=True,
                        )
            for translator in translators.values():
                if hasattr(translator, "close"):  # CTranslate2's processes
                    translator.close()
    return rows


def _batch_ids(decoder, sentences):
    """The padded source ids of a batch of `sentences`, as the translator encodes them."""
    import numpy as np
    from keras_transformer_runtime.specials import EOS_ID

    encoded = [decoder.tokenizer.encode(s) + [EOS_ID] for s in sentences]
    ids = np.zeros((len(encoded), max(map(len, encoded))), np.int64)
    for row, sentence in zip(ids, encoded, strict=True):
        row[: len(sentence)] = sentence
    return ids


def main(argv=None):
    import sys

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("onnx_dir")
    parser.add_argument("--data", default=SHARED_MULTI30K, help="the Multi30k folder")
    parser.add_argument("--src", default="de")
    parser.add_argument("--tgt", default="en")
    parser.add_argument("--splits", nargs="+", default=["val", "test_2016_flickr"])
    parser.add_argument("--precisions", nargs="+", default=["float32", "int8"])
    parser.add_argument("--beams", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--batches", nargs="+", type=int, default=[32])
    parser.add_argument("--threads", nargs="+", type=int, default=[1])
    parser.add_argument(
        "--parallel", type=int, default=1, help="batches searched at once (parallel_batches)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--ctranslate2",
        metavar="RUN",
        help="the run ONNX_DIR was exported from: CTranslate2 on its weights, without and "
        "with the shortlist as its vocabulary map (vmap), beside ours",
    )
    parser.add_argument("--lines", type=int, default=None, help="the first N lines of each split")
    parser.add_argument("--out", default=os.path.join(RESULTS, "shortlist.json"))
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    rows = measure(args)
    write_report("shortlist", args, rows=rows)


if __name__ == "__main__":
    main()
