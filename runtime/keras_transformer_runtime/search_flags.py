"""The decoding flags and output formats of both translate commands, defined once.

`keras-transformer-translate` (ONNX Runtime) and `keras-transformer
translate` / `evaluate` (Keras) both call `add_search_flags(parser)`, whose
flags are made from the fields of `options.SearchOptions` (their names, types,
defaults and help), turn the parsed flags into a `SearchOptions` with
`options_from_args`, and write what they found with `command_output`; so a
flag means the same in both, and in the server's requests. The meaning of each option: docs/decoding.md.
"""

from __future__ import annotations

import json

from keras_transformer_runtime.documents import INPUT_FORMATS, sentence_terms
from keras_transformer_runtime.options import SearchOptions, option_fields

FORMATS = ("text", "tsv", "jsonl")


def _dest(field):
    return field.flag[2:].replace("-", "_")


def add_search_flags(parser, outputs=True):
    """Adds every decoding option of `options.SearchOptions` as a flag (`options.option_fields`:
    its name, type, default and help are the option's own), `--suppress`,
    `--prefix` and `--constraints`, and with `outputs` the options that shape
    the output (--n-best, --token-scores, --alignment) and the output flags
    (--scores, --format, --score), to an argparse parser."""
    group = parser.add_argument_group("decoding options (docs/decoding.md)")
    add = group.add_argument
    for field in option_fields():
        if field.output and not outputs:
            continue
        if field.kind is bool:
            add(field.flag, action="store_true", dest=_dest(field), help=field.help)
            continue
        default = "" if field.optional else f" (default {field.default})"
        add(
            field.flag,
            type=field.kind,
            default=field.default,
            dest=_dest(field),
            help=field.help + default,
        )
    if outputs:
        add(
            "--input-format",
            choices=INPUT_FORMATS,
            default="text",
            help="text: one input line, one translation (default); paragraphs: the input is "
            "a document whose lines are split into sentences, translated, and put back in "
            "place with every line break and space kept; html: a page whose text is "
            "translated in context, its inline tags put back around the aligned words, "
            "everything else kept as written; markdown: the same for a Markdown file, code "
            "and URLs kept (docs/documents.md)",
        )
        add(
            "--source-language",
            metavar="CODE",
            help="the language whose rules split documents into sentences "
            "(default: the export's source_language, else en)",
        )
        add("--scores", action="store_true", help="text format: each line is 'score<TAB>text'")
        add("--format", choices=FORMATS, default="text", help="output format (default text)")
        add(
            "--score",
            metavar="FILE",
            help="forced decoding: print the log-probability of FILE's line N as the "
            "translation of input line N (summed, EOS included) instead of translating",
        )
    add(
        "--prefix",
        metavar="FILE",
        help="target prefixes, one per input line (empty: none): each translation starts so",
    )
    add(
        "--terms",
        metavar="FILE",
        help="a glossary, one 'source term<TAB>target phrase' per line: each sentence that "
        "holds a source term (a whole word, any case) must hold its target phrase "
        "(docs/constraints.md); with any --input-format",
    )
    add(
        "--suppress",
        action="append",
        default=[],
        metavar="TEXT",
        help="a word or phrase never generated (its tokens in a row); repeatable",
    )
    add(
        "--constraints",
        metavar="FILE",
        help="target phrases each translation must hold, line N for input line N: "
        "tab-separated phrases, or a JSON list of strings per line in a .jsonl file; an "
        "empty line for none (docs/constraints.md)",
    )
    return group


def options_from_args(args, tokenizer, **overrides):
    """The `SearchOptions` of parsed flags (`overrides` win, e.g. `beam_size=1` for
    `--greedy`); a bad value exits with a clear error that names the flag."""
    values = {
        field.name: getattr(args, _dest(field))
        for field in option_fields()
        if hasattr(args, _dest(field))
    }
    try:
        values["suppress_sequences"] = [_suppressed(tokenizer, text) for text in args.suppress]
        return SearchOptions(**{**values, **overrides})
    except ValueError as error:
        raise SystemExit(f"error: {_as_flag(str(error))}") from None


def _suppressed(tokenizer, text):
    ids = tokenizer.encode_target(text)
    if not ids:
        raise ValueError(f"--suppress {text!r} has no tokens.")
    return ids


def _as_flag(message):
    """Names options as the flags that set them."""
    for field in option_fields():
        message = message.replace(f"{field.name}=", f"{field.flag}=")
        message = message.replace(f"{field.name} ", f"{field.flag} ")
    return message


def is_plain_run(args, options):
    """Whether the command only translates with the plain search, one text line each."""
    return (
        options.is_plain()
        and options.max_input_length is None
        and not (args.prefix or getattr(args, "score", None) or getattr(args, "scores", False))
        and not options.alignment
        and not args.constraints
        and not args.terms
        and getattr(args, "format", "text") == "text"
    )


def read_lines_file(path, count, flag):
    """The lines of `path` (UTF-8), which must be `count`, one per input line."""
    from keras_transformer_runtime.text import decode_lines

    try:
        with open(path, "rb") as f:
            lines, _ = decode_lines(f.read())
    except OSError as error:
        raise SystemExit(f"error: {flag} {path}: {error.strerror}") from None
    if count is not None and len(lines) != count:
        raise SystemExit(
            f"error: {flag} {path} has {len(lines)} lines for {count} input lines: give one each."
        )
    return lines


def command_output(args, lines, options, translator, progress, warn, parallel_batches=1):
    """What both translate commands write for `lines`: the translations (or, with
    --score, the scores) in --format, from `translator` (a `translator.Translator`,
    over ONNX Runtime or Keras) under `options`, reading --prefix and
    --constraints. With --input-format other than text, `lines` is the whole input,
    one document, and the translated document is written."""
    if getattr(args, "input_format", "text") != "text":
        return _document_output(args, lines, options, translator, progress, warn, parallel_batches)
    if is_plain_run(args, options):
        outputs = translator.translate(
            lines,
            options=options,
            batch_size=args.batch_size,
            progress=progress,
            warn=warn,
            parallel_batches=parallel_batches,
        )
        return "".join(line + "\n" for line in outputs)
    if args.score:
        targets = read_lines_file(args.score, len(lines), "--score")
        scored = translator.score(lines, targets, args.batch_size, progress, warn)
        return "".join(format_score(i, s, args) for i, s in enumerate(scored))
    prefixes = read_lines_file(args.prefix, len(lines), "--prefix") if args.prefix else None
    constraints = read_constraints(args.constraints, len(lines)) if args.constraints else None
    if args.terms:
        if constraints is not None:
            raise ValueError("give --constraints or --terms, not both.")
        constraints = sentence_terms(lines, read_terms(args.terms))
    found = translator.translate_hypotheses(
        lines, options, prefixes, args.batch_size, progress, warn, constraints, parallel_batches
    )
    return "".join(format_hypotheses(i, hs, args) for i, hs in enumerate(found))


def _document_output(args, text, options, translator, progress, warn, parallel_batches):
    """The translation of `text`, one document in --input-format."""
    per_line = (
        ("--score", args.score),
        ("--prefix", args.prefix),
        ("--constraints", args.constraints),
        ("--scores", args.scores),
        (f"--format {args.format}", args.format != "text"),
        ("--plot-attention", getattr(args, "plot_attention", False)),
    )
    for flag, given in per_line:
        if given:
            raise ValueError(
                f"{flag} is for --input-format text; --input-format {args.input_format} "
                "translates a document to a document."
            )
    try:
        (found,) = translator.translate_documents(
            [text],
            args.input_format,
            options,
            args.source_language,
            args.batch_size,
            progress,
            warn,
            parallel_batches,
            read_terms(args.terms) if args.terms else None,
        )
    except ValueError as error:
        raise ValueError(_as_flag(str(error))) from None
    return found


def read_terms(path):
    """The `(source term, target phrase)` pairs of a --terms file; a bad line stops the
    command with an error naming the file and line, before anything is translated."""
    lines = read_lines_file(path, None, "--terms")
    terms = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 2 or not all(f.strip() for f in fields):
            raise ValueError(
                f"--terms {path} line {number} must be a source term and a target phrase "
                f"separated by one tab. Received: {line[:80]!r}"
            )
        terms.append((fields[0], fields[1]))
    return terms


def read_constraints(path, count):
    """The phrases of a --constraints file for `count` input lines; a bad file exits
    with an error naming it and its line (`constraints.read_constraints_file`)."""
    from keras_transformer_runtime.constraints import read_constraints_file

    try:
        return read_constraints_file(path, count)
    except OSError as error:
        raise SystemExit(f"error: --constraints {path}: {error.strerror}") from None
    except ValueError as error:
        raise SystemExit(f"error: --constraints {error}") from None


def _numbers(values):
    return " ".join(f"{v:.4f}" for v in values)


def format_hypotheses(index, hypotheses, args):
    """Line `index`'s hypotheses in --format: text (one line each, 'score<TAB>' first
    with --scores, '<TAB>token scores' after with --token-scores, then '<TAB>' and
    the alignment as 'source-target' pairs with --alignment), tsv (line number,
    rank, score, log_prob, text[, token scores][, alignment]) or jsonl (one object
    per input line)."""
    if args.format == "jsonl":
        return json.dumps({"line": index + 1, "hypotheses": hypotheses}, ensure_ascii=False) + "\n"
    rows = []
    for rank, h in enumerate(hypotheses, 1):
        if args.format == "tsv":
            fields = [str(index + 1), str(rank), f"{h['score']:.4f}", f"{h['log_prob']:.4f}"]
            fields.append(h["text"])
        else:
            fields = ([f"{h['score']:.4f}"] if args.scores else []) + [h["text"]]
        if "token_scores" in h:
            fields.append(_numbers(h["token_scores"]))
        if "alignment" in h:
            fields.append(" ".join(f"{s}-{t}" for t, s in enumerate(h["alignment"])))
        rows.append("\t".join(fields) + "\n")
    return "".join(rows)


def format_score(index, scored, args):
    """Line `index`'s forced-decoding score: text ('log_prob' or, with --token-scores,
    'log_prob<TAB>token scores'; empty for an empty source), tsv (line number first) or jsonl."""
    if args.format == "jsonl":
        return json.dumps({"line": index + 1, **scored}) + "\n"
    total, steps = scored["log_prob"], scored["token_scores"]
    fields = [f"{total:.4f}" if total is not None else ""]
    if args.token_scores:
        fields.append(_numbers(steps) if steps is not None else "")
    if args.format == "tsv":
        fields.insert(0, str(index + 1))
    return "\t".join(fields) + "\n"
