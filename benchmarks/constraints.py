"""Terminology constraints on Multi30k: coverage, BLEU and chrF with and without them.

    python -m benchmarks.constraints ONNX_DIR [--data DIR] [--src de --tgt en]
        [--splits val test_2016_flickr] [--beam 5] [--length-penalty 0.6] [--out JSON]

The protocol (the constraints come from the reference, by a rule fixed
before any score was seen):

1. Translate the split without constraints (beam 5, length penalty 0.6).
2. Per sentence, the constraints are the two longest words of its reference
   (words split on whitespace, outer punctuation stripped, at least 3
   characters; of equal length, the earlier) that are not words of the
   unconstrained translation, so each constraint is information the model
   did not produce on its own. A word the target vocabulary cannot spell
   (it tokenizes to the unknown token) is skipped. A sentence with no such
   word is translated without constraints.
3. Translate again with the constraints (same beam and penalty) and score
   both outputs against the references with sacreBLEU (BLEU, chrF).

Coverage is the share of constraints found in the constrained output: as
text (the phrase appears in the translation; what the search guarantees)
and as a word (it appears between word boundaries; a piece may attach to
it, as "dog" + "s"). Both runs translate the same batches on the same
threads, one after the other; the time of each is in the report. Choose
settings on val; test_2016_flickr is the reported split.
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks import harness

PUNCTUATION = ".,;:!?\"'()[]"


def words(text):
    """The words of `text`: split on whitespace, outer punctuation stripped, empty ones dropped."""
    return [w for w in (w.strip(PUNCTUATION) for w in text.split()) if w]


def choose_constraints(reference, hypothesis, spells, count=2, min_chars=3):
    """The `count` longest reference words of `min_chars` or more that the hypothesis lacks.

    Of equal length, the earlier; each word once; `spells(word)` False skips a
    word the target vocabulary cannot write.
    """
    produced = set(words(hypothesis))
    candidates = []
    for word in words(reference):
        if len(word) >= min_chars and word not in produced and word not in candidates:
            if spells(word):
                candidates.append(word)
    ranked = sorted(candidates, key=lambda w: (-len(w), candidates.index(w)))
    return ranked[:count]


def coverage(outputs, constraints):
    """`(phrases, found as text, found as a word)` over all sentences."""
    total = as_text = as_word = 0
    for output, phrases in zip(outputs, constraints, strict=True):
        output_words = set(words(output))
        for phrase in phrases:
            total += 1
            as_text += phrase in output
            as_word += phrase in output_words
    return total, as_text, as_word


def run_split(translator, sources, references, beam, length_penalty, batch_size):
    from keras_transformer_runtime.specials import UNK_ID

    from keras_transformer.evaluation import score_translations

    def translate(constraints=None):
        settings = dict(beam_size=beam, length_penalty=length_penalty, batch_size=batch_size)
        return harness.timed(translator.translate, sources, constraints=constraints, **settings)

    def spells(word):
        ids = translator.tokenizer.encode(word)
        return bool(ids) and UNK_ID not in ids

    plain, plain_seconds = translate()
    constraints = [
        choose_constraints(ref, hyp, spells) for ref, hyp in zip(references, plain, strict=True)
    ]
    constrained, constrained_seconds = translate(constraints)
    total, as_text, as_word = coverage(constrained, constraints)
    _, plain_text, plain_word = coverage(plain, constraints)
    scores = {
        "plain": score_translations(plain, references),
        "constrained": score_translations(constrained, references),
    }
    return {
        "sentences": len(sources),
        "sentences_constrained": sum(bool(c) for c in constraints),
        "constraints": total,
        "coverage_text": round(100 * as_text / max(total, 1), 2),
        "coverage_word": round(100 * as_word / max(total, 1), 2),
        "coverage_text_plain": round(100 * plain_text / max(total, 1), 2),
        "bleu": {k: v["bleu"] for k, v in scores.items()},
        "chrf": {k: v["chrf"] for k, v in scores.items()},
        "bleu_signature": scores["plain"]["bleu_signature"],
        "seconds": {"plain": round(plain_seconds, 2), "constrained": round(constrained_seconds, 2)},
        "examples": [
            {"reference": r, "constraints": c, "plain": p, "constrained": o}
            for r, c, p, o in list(zip(references, constraints, plain, constrained, strict=True))[
                :3
            ]
        ],
    }


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.constraints", description=__doc__)
    parser.add_argument("onnx_dir")
    parser.add_argument("--data", default=harness.SHARED_MULTI30K)
    parser.add_argument("--src", default="de")
    parser.add_argument("--tgt", default="en")
    parser.add_argument("--splits", nargs="+", default=["val", "test_2016_flickr"])
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--length-penalty", type=float, default=0.6)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads")
    parser.add_argument("--limit", type=int, help="the first N sentences of each split")
    parser.add_argument("--out", default=os.path.join(harness.RESULTS, "constraints-multi30k.json"))
    args = parser.parse_args(argv)
    args.argv = argv

    from keras_transformer_runtime import OnnxTranslator

    translator = OnnxTranslator(
        args.onnx_dir, providers=["CPUExecutionProvider"], num_threads=args.threads
    )
    splits = {}
    for split in args.splits:
        sources, references = harness.multi30k(args.data, split, args.src, args.tgt, args.limit)
        splits[split] = run_split(
            translator, sources, references, args.beam, args.length_penalty, args.batch_size
        )
        print(split, {k: v for k, v in splits[split].items() if k != "examples"}, flush=True)
    harness.write_report(
        "constraints",
        args,
        rule="the two longest reference words (>= 3 characters, outer punctuation stripped) "
        "missing from the unconstrained output; words the vocabulary cannot spell skipped",
        splits=splits,
        load_average_after=harness.load_average(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
