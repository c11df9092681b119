"""Documents: the sentence splitters compared, and paragraphs translated on Multi30k.

    python -m benchmarks.documents splitters [--out JSON]
    python -m benchmarks.documents paragraphs ONNX_DIR [--data DIR] [--src de --tgt en]
        [--split test_2016_flickr] [--beam 4] [--threads N] [--seed 0] [--out JSON]
    python -m benchmarks.documents tags TOY_ONNX_DIR [--beam 4]
    python -m benchmarks.documents multi30k-tags ONNX_DIR [--src de --tgt en]
    python -m benchmarks.documents markup ONNX_DIR [--threads 1] [--repeats 3]
    python -m benchmarks.documents pages ONNX_DIR --html GLOB --markdown GLOB [--count 100]
        [--src en] [--beam 1]

`splitters`: ours (sentencex and the rules of `documents._unmarked_cuts`),
then each installed splitter (sentencex, pysbd, sentence-splitter, syntok,
blingfire) on the hand-checked paragraphs of
`benchmarks/data/sentence_splits.json` (each paragraph is its sentences
joined by a space): paragraphs split exactly as written, per language, and
its speed in sentences per second on the German side of Multi30k's
test_2016_flickr glued into paragraphs. Then the lines of Multi30k's train
and val (de, en, fr) that ours splits further than sentencex alone.

`paragraphs`: the split's sentences are glued into paragraphs of 3 to 8
(`glue`, seeded), and translated three ways: each sentence alone (`text`),
each paragraph as `paragraphs` (split, translated, rebuilt), and each
paragraph whole as one `text` input. All three are scored with sacreBLEU at
the paragraph level, against the paragraph's references joined by a space.

`tags`: the toy pair, whose word alignment is known (each source word's
target words, in reversed order): one seeded word of each test sentence in
`<b>`, translated as HTML; of the outputs equal to the reference, those
whose `<b>` wraps exactly that word's target words.

`multi30k-tags`: one seeded word (of 3+ letters) of each Multi30k
sentence in `<b>`, translated as HTML. eflomal, trained on the training
split with the test sources and the tag-free outputs, links the tagged
word to target words (both directions' links where they agree, else
either's); of the sentences where it links any, the share whose `<b>`
wraps exactly their extent, and the share where it wraps at least one.

`pages`: real pages (`--count` of each glob, seeded), each translated twice
as a document: whether any raises, whether the two runs agree byte for
byte, and whether the markup comes back (`real_pages`).

`markup`: the same sentences translated as text, as an HTML page of
paragraphs, as one with a word of each sentence in `<b>` (each then needs
its alignment), and the same two as Markdown (`**` for `<b>`); median
seconds of `--repeats` interleaved runs.
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

SPLITS = os.path.join(harness.HERE, "data", "sentence_splits.json")


def glue(sentences, seed=0, shortest=3, longest=8):
    """`sentences` in consecutive runs of `shortest` to `longest` (seeded), as index lists."""
    rng = random.Random(seed)
    runs, at = [], 0
    while at < len(sentences):
        size = rng.randint(shortest, longest)
        runs.append(list(range(at, min(at + size, len(sentences)))))
        at += size
    return runs


OURS = "keras-transformer (sentencex and unmarked starts)"


def splitters():
    """name -> `make(language) -> split(text) -> sentences`, for those installed."""
    from keras_transformer_runtime.documents import sentence_spans

    found = {OURS: lambda lang: lambda t: [t[a:b] for a, b in sentence_spans(t, lang)]}
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


def compare_splitters(args):
    with open(SPLITS, encoding="utf-8") as f:
        data = json.load(f)
    german = harness.read_lines(os.path.join(args.data, "test_2016_flickr.de.gz"))
    paragraphs = [" ".join(german[i] for i in run) for run in glue(german)]
    rows = {}
    found = splitters()
    for name, make in found.items():
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
        _, seconds = harness.timed(lambda split=split: [split(p) for p in paragraphs])
        row["sentences_per_second"] = round(len(german) / seconds)
        rows[name] = row
        print(name, row["en"]["exact"], row["de"]["exact"], row["sentences_per_second"])
    # Our rules on top of sentencex split only where punctuation marks nothing: on
    # Multi30k's train and val lines (single sentences, some two), where they split
    # further than sentencex alone, each such line is a false split or a run-on.
    ours, alone = found[OURS], found["sentencex"]
    further = {}
    for language in ("de", "en", "fr"):
        lines = [
            line
            for split in ("train", "val")
            for line in harness.read_lines(os.path.join(args.data, f"{split}.{language}.gz"))
        ]
        ours_split, alone_split = ours(language), alone(language)
        more = [x for x in lines if len(ours_split(x)) > len(alone_split(x))]
        further[language] = {"lines": len(lines), "split_further": more}
        print(language, len(lines), len(more))
    return {"splitters": rows, "multi30k_lines_split_further_than_sentencex": further}


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


def toy_tags(args):
    """`<b>` around one seeded word of each toy test sentence: where the model's output
    is the reference, does the tag wrap exactly that word's target words?"""
    import re

    from keras_transformer_runtime import OnnxTranslator
    from keras_transformer_runtime.options import SearchOptions

    from keras_transformer.data.toy import generate_toy_corpus

    corpus = generate_toy_corpus(num_train=3000, num_valid=50, num_test=500, seed=args.seed)
    rng = random.Random(args.seed)
    pages, wanted = [], []
    for source, _ in corpus.test:
        words = source.split()
        k = rng.randrange(len(words))
        pages.append(" ".join(f"<b>{w}</b>" if i == k else w for i, w in enumerate(words)))
        target = []
        for i in reversed(range(len(words))):  # the toy target: reversed, word by word
            if i == k:
                first, last = len(target), len(target) + len(corpus.table[words[i]]) - 1
            target.extend(corpus.table[words[i]])
        wanted.append(
            " ".join(
                ("<b>" if j == first else "") + w + ("</b>" if j == last else "")
                for j, w in enumerate(target)
            )
        )
    translator = OnnxTranslator(args.onnx_dir, num_threads=args.threads)
    found = translator.translate_documents(pages, "html", SearchOptions(beam_size=args.beam))
    references = [s.replace("<b>", "").replace("</b>", "") for s in wanted]
    exact = [i for i, page in enumerate(found) if re.sub("</?b>", "", page) == references[i]]
    right = sum(found[i] == wanted[i] for i in exact)
    print(f"outputs equal to the reference: {len(exact)}; tags placed right in {right}")
    return {"sentences": len(pages), "reference_outputs": len(exact), "tags_right": right}


def _tag_words(output):
    """The plain text of a translated sentence and the indices of its words inside `<b>`."""
    import html as html_module
    import re

    plain, inside, bold = [], [], False
    for piece in re.split(r"(</?b>)", output):
        if piece in ("<b>", "</b>"):
            bold = piece == "<b>"
            continue
        text = html_module.unescape(piece)
        plain.append(text)
        inside.extend([bold] * len(text))
    text = "".join(plain)
    words = [m.span() for m in re.finditer(r"\S+", text)]
    return text, {i for i, (s, e) in enumerate(words) if any(inside[s:e])}


def multi30k_tags(args):
    """`<b>` around one seeded word (of 3+ letters) of each Multi30k sentence, translated
    as HTML; eflomal aligns the source with the tag-free output (trained with the
    training split), and the tag is scored against the target words it links to the
    tagged word."""
    import html as html_module
    import io
    import tempfile

    import eflomal
    from keras_transformer_runtime import OnnxTranslator
    from keras_transformer_runtime.options import SearchOptions

    sources = harness.read_lines(os.path.join(args.data, f"{args.split}.{args.src}.gz"))
    rng = random.Random(args.seed)
    pages, tagged = [], []
    for sentence in sources:
        words = sentence.split()
        choices = [i for i, w in enumerate(words) if sum(c.isalpha() for c in w) >= 3]
        k = rng.choice(choices or [0])
        tagged.append(k)
        escaped = [html_module.escape(w, quote=False) for w in words]
        pages.append(" ".join(f"<b>{w}</b>" if i == k else w for i, w in enumerate(escaped)))
    translator = OnnxTranslator(args.onnx_dir, num_threads=args.threads)
    outputs = translator.translate_documents(pages, "html", SearchOptions(beam_size=args.beam))
    plain, placed = zip(*map(_tag_words, outputs), strict=True)
    train_src, train_tgt = harness.multi30k(args.data, "train", args.src, args.tgt)
    with tempfile.TemporaryDirectory() as folder:
        links = {}
        for direction in ("fwd", "rev"):
            links[direction] = os.path.join(folder, direction)
        eflomal.Aligner().align(
            io.StringIO("".join(s.lower() + "\n" for s in [*train_src, *sources])),
            io.StringIO("".join(t.lower() + "\n" for t in [*train_tgt, *plain])),
            links_filename_fwd=links["fwd"],
            links_filename_rev=links["rev"],
        )
        pairs = {}
        for direction, path in links.items():
            with open(path) as f:
                rows = f.read().split("\n")[len(train_src) : len(train_src) + len(sources)]
            pairs[direction] = [
                {tuple(map(int, link.split("-"))) for link in row.split()} for row in rows
            ]
    counts = {"aligned": 0, "exact": 0, "overlapping": 0, "tag_empty": 0}
    for k, found, forward, backward in zip(tagged, placed, pairs["fwd"], pairs["rev"], strict=True):
        both = {t for s, t in forward & backward if s == k}
        wanted = both or {t for s, t in forward | backward if s == k}
        if not wanted:
            continue
        counts["aligned"] += 1
        counts["tag_empty"] += not found
        counts["exact"] += found == set(range(min(wanted), max(wanted) + 1))
        counts["overlapping"] += bool(found & wanted)
    print(counts)
    return {"sentences": len(sources), **counts}


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
    import json
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
        "splitters": compare_splitters,
        "paragraphs": translate_paragraphs,
        "tags": toy_tags,
        "multi30k-tags": multi30k_tags,
        "markup": markup_cost,
        "pages": real_pages,
    }
    for name in questions:
        each = sub.add_parser(name)
        if name != "splitters":
            each.add_argument("onnx_dir", help="an export (for tags: of `keras-transformer demo`)")
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
