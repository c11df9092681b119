"""Documents: the sentence splitters compared, and paragraphs translated on Multi30k.

    python -m benchmarks.documents splitters [--out JSON]
    python -m benchmarks.documents paragraphs ONNX_DIR [--data DIR] [--src de --tgt en]
        [--split test_2016_flickr] [--beam 4] [--threads N] [--seed 0] [--out JSON]

`splitters`: each installed splitter (sentencex, pysbd, sentence-splitter,
syntok, blingfire) on the hand-checked paragraphs of
`benchmarks/data/sentence_splits.json` (each paragraph is its sentences
joined by a space): paragraphs split exactly as written, per language, and
its speed in sentences per second on the German side of Multi30k's
test_2016_flickr glued into paragraphs.

`paragraphs`: the split's sentences are glued into paragraphs of 3 to 8
(`glue`, seeded), and translated three ways: each sentence alone (`text`),
each paragraph as `paragraphs` (split, translated, rebuilt), and each
paragraph whole as one `text` input. All three are scored with sacreBLEU at
the paragraph level, against the paragraph's references joined by a space.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import sys
import time

from benchmarks.machine import SHARED_MULTI30K, write_report

HERE = os.path.dirname(os.path.abspath(__file__))
SPLITS = os.path.join(HERE, "data", "sentence_splits.json")


def glue(sentences, seed=0, shortest=3, longest=8):
    """`sentences` in consecutive runs of `shortest` to `longest` (seeded), as index lists."""
    rng = random.Random(seed)
    runs, at = [], 0
    while at < len(sentences):
        size = rng.randint(shortest, longest)
        runs.append(list(range(at, min(at + size, len(sentences)))))
        at += size
    return runs


def splitters():
    """name -> `make(language) -> split(text) -> sentences`, for those installed."""
    found = {}
    try:
        import sentencex

        found["sentencex"] = lambda lang: (
            lambda t: [s.strip() for s in sentencex.segment(lang, t) if s.strip()]
        )
    except ImportError:
        pass
    try:
        import pysbd

        def make_pysbd(lang):
            segmenter = pysbd.Segmenter(language=lang, clean=False)
            return lambda t: [s.strip() for s in segmenter.segment(t) if s.strip()]

        found["pysbd"] = make_pysbd
    except ImportError:
        pass
    try:
        import sentence_splitter

        found["sentence-splitter"] = lambda lang: sentence_splitter.SentenceSplitter(lang).split
    except ImportError:
        pass
    try:
        from syntok import segmenter as syntok

        found["syntok"] = lambda lang: (
            lambda t: [
                "".join(token.spacing + token.value for token in sentence).strip()
                for paragraph in syntok.analyze(t)
                for sentence in paragraph
            ]
        )
    except ImportError:
        pass
    try:
        import blingfire

        found["blingfire"] = lambda lang: lambda t: blingfire.text_to_sentences(t).split("\n")
    except ImportError:
        pass
    return found


def read(path):
    with gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path) as f:
        return [line.rstrip("\n") for line in f]


def compare_splitters(args):
    with open(SPLITS, encoding="utf-8") as f:
        data = json.load(f)
    german = read(os.path.join(args.data, "test_2016_flickr.de.gz"))
    paragraphs = [" ".join(german[i] for i in run) for run in glue(german)]
    rows = {}
    for name, make in splitters().items():
        row = {}
        for language in ("en", "de"):
            split = make(language)
            wrong = [s for s in data[language] if split(" ".join(s)) != s]
            row[language] = {
                "exact": len(data[language]) - len(wrong),
                "paragraphs": len(data[language]),
                "wrong": [split(" ".join(s)) for s in wrong],
            }
        split = make("de")
        start = time.perf_counter()
        for paragraph in paragraphs:
            split(paragraph)
        row["sentences_per_second"] = round(len(german) / (time.perf_counter() - start))
        rows[name] = row
        print(name, row["en"]["exact"], row["de"]["exact"], row["sentences_per_second"])
    return {"splitters": rows}


def translate_paragraphs(args):
    import sacrebleu
    from keras_transformer_runtime import OnnxTranslator
    from keras_transformer_runtime.options import SearchOptions

    sources = read(os.path.join(args.data, f"{args.split}.{args.src}.gz"))
    references = read(os.path.join(args.data, f"{args.split}.{args.tgt}.gz"))
    runs = glue(sources, args.seed)
    paragraphs = [" ".join(sources[i] for i in run) for run in runs]
    joined_refs = [" ".join(references[i] for i in run) for run in runs]
    translator = OnnxTranslator(args.onnx_dir, num_threads=args.threads)
    options = SearchOptions(beam_size=args.beam)
    ways = {
        "sentences_alone": lambda: translator.translate(sources, options=options),
        "paragraphs": lambda: translator.translate_documents(
            paragraphs, "paragraphs", options, args.src
        ),
        "whole_paragraph_as_text": lambda: translator.translate(paragraphs, options=options),
    }
    report = {"paragraph_count": len(runs), "sentence_count": len(sources)}
    for name, way in ways.items():
        start = time.perf_counter()
        outputs = way()
        seconds = time.perf_counter() - start
        if name == "sentences_alone":  # the paragraph's sentences' translations, joined
            outputs = [" ".join(outputs[i] for i in run) for run in runs]
        report[name] = {
            "bleu": round(sacrebleu.corpus_bleu(outputs, [joined_refs]).score, 2),
            "chrf": round(sacrebleu.corpus_chrf(outputs, [joined_refs]).score, 2),
            "seconds": round(seconds, 2),
        }
        print(name, report[name])
    # Where the splitter did not find the glued sentences, and the share where one of
    # them (not the last) ends without a full stop, so that nothing marks its end.
    documents = translator.documents(paragraphs, "paragraphs", args.src)
    missed = [
        run
        for document, run in zip(documents, runs, strict=True)
        if document.sentences != [sources[i].strip() for i in run]
    ]
    report["paragraphs_split_otherwise"] = len(missed)
    report["of_which_a_sentence_has_no_final_stop"] = sum(
        any(not sources[i].rstrip().endswith((".", "!", "?", '"')) for i in run[:-1])
        for run in missed
    )
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.documents")
    sub = parser.add_subparsers(dest="question", required=True)
    one = sub.add_parser("splitters")
    two = sub.add_parser("paragraphs")
    two.add_argument("onnx_dir")
    two.add_argument("--src", default="de")
    two.add_argument("--tgt", default="en")
    two.add_argument("--split", default="test_2016_flickr")
    two.add_argument("--beam", type=int, default=4)
    two.add_argument("--threads", type=int)
    two.add_argument("--seed", type=int, default=0)
    for each in (one, two):
        each.add_argument("--data", default=SHARED_MULTI30K, help="the Multi30k mirror")
        each.add_argument("--out", help="the report (default: benchmarks/results/documents-*.json)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.out = args.out or os.path.join(HERE, "results", f"documents-{args.question}.json")
    run = compare_splitters if args.question == "splitters" else translate_paragraphs
    write_report("documents", args, **run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
