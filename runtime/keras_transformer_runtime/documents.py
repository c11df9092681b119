"""Documents in, documents out: the sentences of a text, and the text rebuilt around their translations.

`Translator.translate_documents` takes whole texts in one of `INPUT_FORMATS`:

- `text`: the text is one input, as `translate` takes it;
- `paragraphs`: every line is split into sentences (`sentence_spans`), the
  sentences are translated, and the text is rebuilt around them: line
  breaks, blank lines and the whitespace between and around sentences come
  back exactly where they were.

A `Document` holds the text and the spans of its sentences; `rebuild` puts
translations in their places. With no translation (each sentence given back
as it was) the text comes back byte for byte.

The sentence splitter is sentencex (Wikimedia's rules for about 300
languages, compiled): it was the most accurate of five splitters on a
hand-checked set of German and English paragraphs and by far the fastest
(`benchmarks/documents.py`, docs/documents.md). It is chosen per source
language; an unknown language code falls back to its generic rules.

Needs sentencex (a dependency of the runtime) and the standard library.
"""

from __future__ import annotations

import dataclasses
import re

INPUT_FORMATS = ("text", "paragraphs", "html", "markdown")
_WORD = re.compile(r"\S+")
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_input_format(input_format):
    if input_format not in INPUT_FORMATS:
        raise ValueError(
            f"unknown input format {input_format!r}; the formats are {', '.join(INPUT_FORMATS)}."
        )
    return input_format


def _stripped(text, start, end):
    """`(start, end)` without the whitespace at either side (an empty span if all is)."""
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


# Sentence starts that punctuation does not mark, per language (docs/documents.md,
# "Sentence splitting"): a determiner or number word, capitalized after a word
# with no stop, begins a sentence (a run-on: "... in einer Stadt Der Mann ...").
# No "The", "Le", "La", "Les" (newspapers, bands, titles), no "Acht" ("außer
# Acht"). Of the 90,042 lines of Multi30k's train and val in de, en and fr, these
# rules split one further than sentencex does (a German line run on itself).
_UNMARKED_STARTS = {
    "de": frozenset(
        "Ein Eine Einige Der Die Das Zwei Drei Vier Fünf Sechs Sieben Neun Zehn Mehrere Viele".split()
    ),
    "en": frozenset("A An Two Three Four Five Six Seven Eight Nine Ten Several".split()),
    "fr": frozenset("Un Une Deux Trois Quatre Cinq Six Sept Huit Neuf Dix Plusieurs".split()),
}
# German rules never end a sentence at a full stop before a number ("Abs. 2",
# "ca. 200"); after a word of three letters or more that is none of these
# abbreviations, and no street ("Goethestr. 12"), that stop ends one
# ("... eine Kurve. 3 Spieler ...").
_GERMAN_NUMBER_ABBREVIATIONS = frozenset(
    "abb abs abzgl anl anm art aufl bde bsp bzw evtl ggf hrsg inkl jhd kap lfg mio min mrd pkt"
    " sek std tab tel tsd vgl zif ziff zzgl".split()
)
_CANDIDATES = {}


def _candidates(language):
    """The pattern of the places that may start an unmarked sentence in
    `language` (None where it has no rules), compiled once."""
    key = language.split("-")[0].lower()
    if key not in _CANDIDATES:
        parts = []
        if key in _UNMARKED_STARTS:
            words = "|".join(sorted(_UNMARKED_STARTS[key]))
            parts.append(rf"(?<=[^\W\d_])\s+(?P<word>{words})(?=\s)")
        if key == "de":
            parts.append(r"(?<!\S)(?P<stem>[^\W\d_]{3,})\.\s+(?P<number>\d)")
        _CANDIDATES[key] = re.compile("|".join(parts)) if parts else None
    return _CANDIDATES[key]


def _unmarked_cuts(line, start, end, language):
    """Places inside the sentence `line[start:end]` where a sentence starts that
    its punctuation does not mark (see `_UNMARKED_STARTS`): a run-on needs three
    words on either side, a number after a stop one word before that stop."""
    pattern = _candidates(language)
    if pattern is None:
        return []
    cuts = []
    for found in pattern.finditer(line, start, end):
        if found.group("word"):
            cut = found.start("word")
            if len(line[start:cut].split()) >= 3 and len(line[cut:end].split()) >= 4:
                cuts.append(cut)
        else:
            stem = found.group("stem").lower()
            if (
                stem not in _GERMAN_NUMBER_ABBREVIATIONS
                and not stem.endswith("str")
                and line[start : found.start("stem")].strip()
            ):
                cuts.append(found.start("number"))
    return cuts


def sentence_spans(text, language="en"):
    """The `(start, end)` of each sentence of `text`, whitespace around it left out.

    A line break always ends a sentence: a sentence never spans two lines.
    Where the splitter's pieces do not cover a line exactly as written (it
    never happened in testing, but it is a compiled library's promise, not
    ours), the line is one sentence: no text is ever lost.
    """
    import sentencex

    spans = []
    offset = 0
    for line in text.split("\n"):
        # The splitter takes Unicode text only: a lone surrogate is split as U+FFFD
        # (one character for one, so the offsets hold).
        probe = _SURROGATE.sub("\ufffd", line)
        pieces = sentencex.get_sentence_boundaries(language, probe) if line.strip() else []
        covered = 0
        found = []
        for piece in pieces:
            start, end = piece["start_index"], piece["end_index"]
            if start != covered or probe[start:end] != piece["text"]:
                found = [(0, len(line))]
                break
            found.append((start, end))
            covered = end
        else:
            if covered != len(line) and line[covered:].strip():
                found.append((covered, len(line)))
        for piece_start, piece_end in found:
            inside = _unmarked_cuts(line, piece_start, piece_end, language)
            for start, end in zip([piece_start, *inside], [*inside, piece_end], strict=True):
                start, end = _stripped(line, start, end)
                if start < end:
                    spans.append((offset + start, offset + end))
        offset += len(line) + 1
    return spans


@dataclasses.dataclass
class Document:
    """A text and the spans of the sentences to translate in it (in order, not overlapping)."""

    text: str
    spans: list

    @property
    def sentences(self):
        return [self.text[start:end] for start, end in self.spans]

    @property
    def starts(self):
        """Where each sentence starts in the text."""
        return [start for start, _ in self.spans]

    @property
    def tagged(self):
        """Per sentence, whether its translation needs alignments (never, in plain text)."""
        return [False] * len(self.spans)

    def rebuild(self, translations, alignments=None):
        """The text with each sentence replaced by its translation, everything else kept."""
        if len(translations) != len(self.spans):
            raise ValueError(f"{len(translations)} translations for {len(self.spans)} sentences.")
        out, at = [], 0
        for (start, end), translation in zip(self.spans, translations, strict=True):
            out.append(self.text[at:start])
            out.append(translation)
            at = end
        out.append(self.text[at:])
        return "".join(out)

    def split_long(self, count_tokens, limit):
        """This document with every sentence of more than `limit` tokens
        (`count_tokens(text)`) cut into pieces of at most `limit` tokens at
        spaces (inside a word only where one word alone is longer), each its
        own sentence: none is cut off."""
        spans = []
        for start, end in self.spans:
            if count_tokens(self.text[start:end]) <= limit:
                spans.append((start, end))
                continue
            spans.extend(self._pieces(start, end, count_tokens, limit))
        return Document(self.text, spans)

    def _pieces(self, start, end, count_tokens, limit):
        pieces = []
        piece_start = piece_end = None
        for word in _WORD.finditer(self.text, start, end):
            if (
                piece_start is not None
                and count_tokens(self.text[piece_start : word.end()]) <= limit
            ):
                piece_end = word.end()
                continue
            if piece_start is not None:
                pieces.append((piece_start, piece_end))
            piece_start, piece_end = word.start(), word.end()
            while count_tokens(self.text[piece_start:piece_end]) > limit:
                cut = _longest_prefix(self.text, piece_start, piece_end, count_tokens, limit)
                pieces.append((piece_start, cut))
                piece_start = cut
        if piece_start is not None:
            pieces.append((piece_start, piece_end))
        return pieces


def _longest_prefix(text, start, end, count_tokens, limit):
    """The end of the longest `text[start:cut]` (one character at least) of at most `limit` tokens."""
    low, high = start + 1, end - 1
    while low < high:
        middle = (low + high + 1) // 2
        if count_tokens(text[start:middle]) <= limit:
            low = middle
        else:
            high = middle - 1
    return low


def parse_document(text, input_format, language="en", split_long=None):
    """The `Document` of `text` in `input_format` (one of `INPUT_FORMATS`); with
    `split_long` (`(count_tokens, limit)`), sentences over the limit cut into
    pieces (`Document.split_long`)."""
    check_input_format(input_format)
    if input_format == "text":  # one input, translated as `translate` does it
        return Document(text, [(0, len(text))])
    if input_format == "html":
        from keras_transformer_runtime.markup import html_document

        return html_document(text, language, split_long)
    if input_format == "markdown":
        from keras_transformer_runtime.markdown import markdown_document

        return markdown_document(text, language, split_long)
    document = Document(text, sentence_spans(text, language))
    return document.split_long(*split_long) if split_long is not None else document


def rebuild_documents(documents, translations, links):
    """Each document rebuilt around its share of `translations` (and of `links`, the
    word links of its sentences with inline tags), taken in order."""
    rebuilt, at = [], 0
    for document in documents:
        count = len(document.sentences)
        rebuilt.append(document.rebuild(translations[at : at + count], links[at : at + count]))
        at += count
    return rebuilt


def check_terms(terms):
    """`terms` as a list of `(source term, target phrase)` string pairs, or a ValueError
    naming the bad one."""
    if isinstance(terms, dict):
        terms = list(terms.items())
    checked = []
    for n, pair in enumerate(terms):
        if (
            not isinstance(pair, (list, tuple))
            or len(pair) != 2
            or not all(isinstance(x, str) and x.strip() for x in pair)
        ):
            raise ValueError(
                f"term {n + 1} ({pair!r}) must be a source term and a target phrase, "
                "two non-empty strings."
            )
        checked.append((pair[0].strip(), pair[1].strip()))
    return checked


def sentence_terms(sentences, terms):
    """Per sentence, the target phrases of the `terms` whose source term it holds: as
    whole words, whatever their case ("Hund" holds in "Der hund bellt.", not in
    "Hundehütte"). A target phrase is held once however often its term occurs."""
    patterns = [
        (re.compile(r"(?<!\w)" + re.escape(source) + r"(?!\w)", re.IGNORECASE), target)
        for source, target in check_terms(terms)
    ]
    found = []
    for sentence in sentences:
        phrases = []
        for pattern, target in patterns:
            if target not in phrases and pattern.search(sentence):
                phrases.append(target)
        found.append(phrases)
    return found


def sentence_places(docs):
    """A function that rewrites a message about the sentences of `docs` as a list
    ("line N", "3 of 40 lines") to name each by its line in its text (and its
    text's number, if there are several)."""
    places = []
    for number, document in enumerate(docs, 1):
        for start in document.starts:
            line = document.text.count("\n", 0, start) + 1
            places.append(f"text {number}, line {line}" if len(docs) > 1 else f"line {line}")

    def located(message):
        message = re.sub(
            r"\bline (\d+)", lambda m: f"the sentence at {places[int(m[1]) - 1]}", message
        )
        return re.sub(r"\b(\d+) of (\d+) lines\b", r"\1 of \2 sentences", message)

    return located
