"""Documents: paragraphs translated on Multi30k, what markup costs, and real pages.

    python -m benchmarks.documents paragraphs ONNX_DIR [--data DIR] [--src de --tgt en]
        [--split test_2016_flickr] [--beam 4] [--threads N] [--seed 0] [--out JSON]
    python -m benchmarks.documents markup ONNX_DIR [--threads 1] [--repeats 3]
    python -m benchmarks.documents pages ONNX_DIR --html GLOB --markdown GLOB [--count 100]
        [--src en] [--beam 1] [--via api|server|command] [--precision float32|int8]

`paragraphs`: the split's sentences glued into paragraphs of 3 to 8 (`glue`,
seeded) and translated each sentence alone, each paragraph as `paragraphs`
(split, translated, rebuilt), and each paragraph whole as one text; all
scored with sacreBLEU against the paragraph's references joined by a space.

`markup`: the same sentences as text, as an HTML page of paragraphs, as one
with a word of each sentence in `<b>` (each then needs its alignment), and
the same two as Markdown (`**` for `<b>`); median of `--repeats`
interleaved runs.

`pages`: real pages (`--count` of each glob, seeded), each translated twice
as a document: whether any raises, whether the two runs agree byte for
byte, and whether the markup comes back (`real_pages`).

The sentence splitters compared and the tags placed (docs/documents.md) were
measured by this script's `splitters`, `tags` and `multi30k-tags` questions,
retired since (in git before the commit that retired them).
"""

from __future__ import annotations

import argparse
import html.parser as html_parser
import json
import os
import random
import statistics
import sys

from benchmarks import harness


def glue(sentences, seed=0, shortest=3, longest=8):
    """`sentences` in consecutive runs of `shortest` to `longest` (seeded), as index lists."""
    rng = random.Random(seed)
    runs, at = [], 0
    while at < len(sentences):
        size = rng.randint(shortest, longest)
        runs.append(list(range(at, min(at + size, len(sentences)))))
        at += size
    return runs


def translate_paragraphs(args):
    import sacrebleu
    from keras_transformer_runtime import OnnxTranslator
    from keras_transformer_runtime.options import SearchOptions

    sources, references = harness.multi30k(args.data, args.split, args.src, args.tgt)
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
        outputs, seconds = harness.timed(way)
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


def markup_cost(args):
    """Seconds to translate Multi30k's sentences as text, as HTML paragraphs, and as HTML
    paragraphs with one word of each in `<b>` (every sentence then needs alignments)."""
    from keras_transformer_runtime import OnnxTranslator
    from keras_transformer_runtime.options import SearchOptions

    sources = harness.read_lines(os.path.join(args.data, f"{args.split}.{args.src}.gz"))
    rng = random.Random(args.seed)
    tagged = []
    for sentence in sources:
        words = sentence.split()
        k = rng.randrange(len(words))
        tagged.append(" ".join(f"<b>{w}</b>" if i == k else w for i, w in enumerate(words)))
    html = "\n".join(f"<p>{s}</p>" for s in sources)
    html_tagged = "\n".join(f"<p>{s}</p>" for s in tagged)
    markdown = "\n\n".join(sources) + "\n"
    markdown_tagged = "\n\n".join(t.replace("<b>", "**").replace("</b>", "**") for t in tagged)
    translator = OnnxTranslator(args.onnx_dir, num_threads=args.threads)
    options = SearchOptions(beam_size=args.beam)
    ways = {
        "text": lambda: translator.translate(sources, options=options),
        "html": lambda: translator.translate_documents([html], "html", options, args.src),
        "html_every_sentence_tagged": lambda: translator.translate_documents(
            [html_tagged], "html", options, args.src
        ),
        "markdown": lambda: translator.translate_documents(
            [markdown], "markdown", options, args.src
        ),
        "markdown_every_sentence_tagged": lambda: translator.translate_documents(
            [markdown_tagged], "markdown", options, args.src
        ),
    }
    measured = harness.interleaved(ways, args.repeats)  # the median kept
    report = {name: round(statistics.median(t), 3) for name, (t, _) in measured.items()}
    for name in list(ways)[1:]:
        report[f"{name}_over_text"] = round(report[name] / report["text"], 3)
    print(report)
    return {"seconds_median": report, "sentences": len(sources)}


class _Markup(html_parser.HTMLParser):
    """A page's tags (attributes but the translated ones) and untranslated text."""

    def __init__(self, text):
        super().__init__(convert_charrefs=False)
        self.tags, self.kept, self.open = [], [], []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs, kind="start"):
        from keras_transformer_runtime.markup import TRANSLATED_ATTRIBUTES, UNTRANSLATED, VOID

        kept = [(k, v) for k, v in attrs if k not in TRANSLATED_ATTRIBUTES | {"value", "content"}]
        self.tags.append((kind, tag, tuple(kept)))
        if tag in UNTRANSLATED and tag not in VOID and kind == "start":
            self.open.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs, "self")

    def handle_endtag(self, tag):
        self.tags.append(("end", tag, ()))
        if self.open and self.open[-1] == tag:
            self.open.pop()

    def handle_data(self, data):
        if self.open:
            self.kept.append(data)

    def handle_comment(self, data):
        self.kept.append(data)

    def nested(self):
        from keras_transformer_runtime.markup import VOID

        stack = []
        for kind, tag, _ in self.tags:
            if tag in VOID or kind == "self":
                continue
            if kind == "start":
                stack.append(tag)
            elif not stack or stack.pop() != tag:
                return False
        return True


def _markdown_kept(text):
    """A Markdown file's code blocks, code spans and link and image targets."""
    from markdown_it import MarkdownIt

    found = []

    def walk(tokens):
        for token in tokens:
            if token.type in ("fence", "code_block", "code_inline", "html_block"):
                found.append((token.type, token.content))
            elif token.type in ("link_open", "image"):
                found.append((token.type, token.attrs.get("href") or token.attrs.get("src")))
            walk(token.children or ())

    walk(MarkdownIt("commonmark").enable(["table", "strikethrough"]).parse(text))
    return sorted(found, key=repr)


def real_pages(args):
    """Pages the project never saw, each translated twice as a document: whether any
    raises, whether both runs give the same bytes, and whether the markup comes back
    (HTML: every tag and attribute but the translated values, untranslated text, the
    nesting; Markdown: code blocks, code spans, link and image targets)."""
    import glob
    import traceback

    from keras_transformer_runtime import OnnxTranslator
    from keras_transformer_runtime.options import SearchOptions

    rng = random.Random(args.seed)
    chosen = []
    for fmt, pattern in (("html", args.html), ("markdown", args.markdown)):
        found = sorted(glob.glob(pattern, recursive=True)) if pattern else []
        chosen += [(path, fmt) for path in rng.sample(found, min(args.count, len(found)))]
    translator = OnnxTranslator(args.onnx_dir, precision=args.precision, num_threads=args.threads)
    options = SearchOptions(beam_size=args.beam)
    again, stop = _second_translation(args)
    problems, sentences, seconds = [], 0, 0.0
    try:
        for path, fmt in chosen:
            with open(path, "rb") as f:
                page = f.read().decode("utf-8", "replace")
            try:
                first, took = harness.timed(
                    translator.translate_documents, [page], fmt, options, args.src
                )
                second = again(translator, page, fmt, options)
            except Exception:  # noqa: BLE001 - every failure is a finding, named in the report
                problems.append({"path": path, "problem": traceback.format_exc(limit=3)})
                continue
            seconds += took
            sentences += len(translator.documents([page], fmt, args.src)[0].sentences)
            found, outputs = [], [("", first[0])]
            if first != second:  # then the markup of both translations is checked
                found.append(f"differs between the API and the {args.via}")
                outputs = [("API: ", first[0]), (f"{args.via}: ", second[0])]
            for who, output in outputs:
                found += [who + problem for problem in _markup_problems(page, output, fmt)]
            problems += [{"path": path, "problem": problem} for problem in found]
    finally:
        stop()
    print(f"{len(chosen)} documents, {sentences} sentences, {len(problems)} problems")
    for problem in problems:
        print(problem["path"], problem["problem"], sep="\n  ")
    return {"documents": len(chosen), "sentences": sentences, "seconds": round(seconds, 1),
            "problems": problems}  # fmt: skip


def _markup_problems(page, output, fmt):
    """What of `page`'s markup its translation `output` lost or changed."""
    if fmt != "html":
        return (
            []
            if _markdown_kept(page) == _markdown_kept(output)
            else ["code or link targets changed"]
        )
    before, after = _Markup(page), _Markup(output)
    found = []
    if sorted(map(repr, before.tags)) != sorted(map(repr, after.tags)):
        found.append("tags lost, added or changed")
    if sorted(before.kept) != sorted(after.kept):
        found.append("untranslated text changed")
    if before.nested() and not after.nested():
        found.append("nesting broken")
    return found


def _second_translation(args):
    """`(again(translator, page, fmt, options), stop())`: the page translated a second
    time through `args.via`: the API again, the HTTP server, or the translate command."""
    import subprocess
    import tempfile
    import urllib.request

    if args.via == "api":
        return (lambda t, page, fmt, options: t.translate_documents([page], fmt, options, args.src),
                lambda: None)  # fmt: skip
    if args.via == "command":
        command = [sys.executable, "-m", "keras_transformer_runtime.translate", args.onnx_dir]
        command += ["--beam", str(args.beam)]
        command += ["--source-language", args.src, "--precision", args.precision]
        command += ["--threads", str(args.threads)] * bool(args.threads)

        def run(translator, page, fmt, options):
            done = subprocess.run([*command, "--input-format", fmt], input=page.encode(),
                                  capture_output=True, check=True)  # fmt: skip
            return [done.stdout.decode()]

        return run, lambda: None
    from benchmarks.serve_load import ServerProcess

    flags = ["--max-chars", str(10**8), "--request-timeout", "3600", "--precision", args.precision]
    flags += ["--threads", str(args.threads)] * bool(args.threads)
    log = os.path.join(tempfile.gettempdir(), "documents-pages-serve.log")
    server = ServerProcess(args.onnx_dir, flags, log)

    def post(translator, page, fmt, options):
        body = {"texts": [page], "format": fmt, "source_language": args.src,
                "beam_size": args.beam}  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/translate", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.load(response)["translations"]

    return post, server.stop


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.documents")
    sub = parser.add_subparsers(dest="question", required=True)
    questions = {
        "paragraphs": translate_paragraphs,
        "markup": markup_cost,
        "pages": real_pages,
    }
    for name in questions:
        each = sub.add_parser(name)
        each.add_argument("onnx_dir", help="an export")
        each.add_argument("--src", default="de")
        each.add_argument("--tgt", default="en")
        each.add_argument("--split", default="test_2016_flickr")
        each.add_argument("--beam", type=int, default=4)
        each.add_argument("--threads", type=int)
        each.add_argument("--seed", type=int, default=0)
        each.add_argument("--repeats", type=int, default=3)
        if name == "pages":
            each.add_argument("--html", help="a glob of HTML pages (** for every folder)")
            each.add_argument("--markdown", help="a glob of Markdown files")
            each.add_argument("--count", type=int, default=100, help="pages of each format")
            each.add_argument(
                "--via",
                choices=["api", "server", "command"],
                default="api",
                help="the second translation of each page, compared with the API's",
            )
            each.add_argument("--precision", default="float32", choices=["float32", "int8"])
        each.add_argument("--data", default=harness.SHARED_MULTI30K, help="the Multi30k mirror")
        each.add_argument("--out", help="the report (default: benchmarks/results/documents-*.json)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.out = args.out or os.path.join(harness.RESULTS, f"documents-{args.question}.json")
    harness.write_report("documents", args, **questions[args.question](args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
