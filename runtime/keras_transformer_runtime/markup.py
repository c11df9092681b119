"""HTML documents: the sentences of a page's text, and the page rebuilt around their translations.

`html_document(page, language)` reads a page with the standard library's
HTML tokenizer (`html.parser`), which reports where in the page each tag,
text and entity stands; a tree-building parser re-serializes the page
(entities, quoting, implied tags), so it could not give the page back byte
for byte. What it does, and why:

- Text is translated in context: the text between two block boundaries (any
  tag but the inline ones of `INLINE`, such as `<b>`, `<a>`, `<span>`) is
  one run, inline tags and entities included, split into sentences as
  `documents.sentence_spans` splits a line. `Ein <b>großer</b> Hund` is one
  sentence, translated once.
- The contents of `<script>`, `<style>`, `<code>`, `<pre>`, `<textarea>`,
  `<svg>`, `<math>`, and of any element with `translate="no"` (or the
  `notranslate` class), comments, declarations and CDATA are never
  touched.
- Every tag is copied from the page as written: attributes, their quoting
  and order. Text outside the translated sentences (whitespace, entities
  between them) is copied as written too.
- A translated sentence is HTML-escaped (`&`, `<`, `>`), and its inline tags
  are put back around the target words aligned to the source words they
  wrapped (`place_tags`, from the alignments of `Translator.align_ids`);
  a tag whose words aligned to none is kept, empty, at the nearer end of
  the sentence. Tags come back properly nested, as they were.
- A sentence given back unchanged (not translated) keeps its markup byte
  for byte: a page with nothing translated comes back as it was.

Needs the standard library only (and sentencex, through `documents`).
"""

from __future__ import annotations

import dataclasses
import html
import re
from html.parser import HTMLParser

from keras_transformer_runtime.documents import Document, sentence_spans
from keras_transformer_runtime.tag_placement import escape_html, place_tags, spans_apart

# Phrasing elements: they do not end a run of text.
INLINE = frozenset(
    "a abbr b bdi bdo big cite data del dfn em font i img ins kbd label mark q s samp "
    "small span strike strong sub sup time tt u var wbr".split()
)
# Elements whose contents are never translated (and raw-text elements).
UNTRANSLATED = frozenset("script style code pre textarea svg math noscript template".split())
# Untranslated elements that sit inside a sentence (`code`, or an inline element with
# translate="no"): kept whole, in place, by the aligned word after them.
KEPT_INLINE = INLINE | {"code"}
VOID = frozenset("area base br col embed hr img input link meta param source track wbr".split())
# Attributes whose values are text for people to read: translated as sentences.
TRANSLATED_ATTRIBUTES = frozenset({"alt", "title", "placeholder", "aria-label"})
# A button's label (`<input type=submit value=...>`) and a page's description for
# search results and link previews (`<meta name=description content=...>`).
BUTTON_TYPES = frozenset({"button", "submit", "reset"})
DESCRIPTIONS = frozenset(
    {"description", "og:title", "og:description", "twitter:title", "twitter:description"}
)
_ATTRIBUTE = re.compile(r"""\s([^\s"'<>/=]+)\s*=\s*(?:(["'])(.*?)\2|([^\s"'=<>`]+))""", re.DOTALL)
_ENTITY_REF = re.compile(r"&(#[0-9]+|#[xX][0-9a-fA-F]+|[A-Za-z][A-Za-z0-9]*);?")


@dataclasses.dataclass
class MarkupToken:
    kind: str  # "text", "open", "close", "void", "other"
    start: int
    end: int
    tag: str = ""
    text: str = ""  # the decoded text of a text token
    untranslated: bool = False  # an element with translate="no" or class notranslate
    written: str = ""  # how it is written around a translation, where not as in the page


class HtmlTokenizer(HTMLParser):
    """The page as `MarkupToken`s with their offsets (each ends where the next starts)."""

    def __init__(self, page):
        super().__init__(convert_charrefs=False)
        self.page = page
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", page)]
        self.events = []  # (kind, offset, tag, attrs)
        self.feed(page)
        self.close()

    def _at(self):
        line, column = self.getpos()
        return self.line_starts[line - 1] + column

    def handle_starttag(self, tag, attrs):
        self.events.append(("void" if tag in VOID else "open", self._at(), tag, attrs))

    def handle_startendtag(self, tag, attrs):
        self.events.append(("void", self._at(), tag, attrs))

    def handle_endtag(self, tag):
        self.events.append(("close", self._at(), tag, ()))

    def handle_data(self, data):
        self.events.append(("text", self._at(), "", ()))

    def handle_entityref(self, name):
        self.events.append(("text", self._at(), "", ()))

    handle_charref = handle_entityref

    def handle_comment(self, data):
        self.events.append(("other", self._at(), "", ()))

    handle_decl = handle_pi = unknown_decl = handle_comment

    def tokens(self):
        if not self.events or self.events[0][1] > 0:  # nothing is ever left out
            self.events.insert(0, ("other", 0, "", ()))
        ends = [offset for _, offset, _, _ in self.events[1:]] + [len(self.page)]
        found = []
        for (kind, start, tag, attrs), end in zip(self.events, ends, strict=True):
            if start == end:
                continue
            token = MarkupToken(kind, start, end, tag)
            if kind == "text":
                token.text = html.unescape(self.page[start:end])
            elif kind in ("open", "void") and _no_translate(attrs):
                token.kind, token.untranslated = "open", True
            found.append(token)
        return found


def _no_translate(attrs):
    for name, value in attrs:
        if name == "translate" and (value or "").strip().lower() == "no":
            return True
        if name == "class" and "notranslate" in (value or "").split():
            return True
    return False


@dataclasses.dataclass
class _Sentence:
    start: int  # the page offsets of its first and after its last character
    end: int
    text: str  # its plain text
    tags: list  # (position in `text`, MarkupToken) of the inline tags inside it
    escape: object = None  # its own escape (an attribute value's), else the document's
    owner: object = None  # the tag of an attribute value's sentence


@dataclasses.dataclass
class HtmlDocument:
    """A page and its sentences; `rebuild(translations, words)` gives the translated page."""

    text: str
    parts: list  # _Sentence
    escape: object = escape_html  # a translation's text as it goes into the page

    @property
    def sentences(self):
        return [part.text for part in self.parts]

    @property
    def starts(self):
        """Where each sentence starts in the page."""
        return [part.start for part in self.parts]

    @property
    def tagged(self):
        """Per sentence, whether it holds inline tags (its translation needs alignments)."""
        return [bool(part.tags) for part in self.parts]

    def rebuild(self, translations, alignments=None):
        """The page with each sentence replaced by its (escaped) translation.

        `alignments[i]`, for a sentence with inline tags, is a list of
        `(source word, target word)` index pairs (`word_links`); without
        one, its tags are kept at the sentence's end. An attribute value's
        sentence inside a tag that another sentence holds goes back with
        that tag."""
        if len(translations) != len(self.parts):
            raise ValueError(f"{len(translations)} translations for {len(self.parts)} sentences.")
        inner = {id(tag) for part in self.parts for _, tag in part.tags}
        raws, edits = {}, {}  # the tags whose attribute values are translated
        for part, translation in zip(self.parts, translations, strict=True):
            if part.owner is not None and id(part.owner) in inner and translation != part.text:
                value = self._render(part, translation, None)
                edits.setdefault(id(part.owner), (part.owner, []))[1].append((part, value))
        for owner, changes in edits.values():
            raw, at = [], owner.start
            for part, value in sorted(changes, key=lambda change: change[0].start):
                raw += [self.text[at : part.start], value]
                at = part.end
            raws[id(owner)] = "".join(raw) + self.text[at : owner.end]
        order = sorted(
            (
                i
                for i, part in enumerate(self.parts)
                if part.owner is None or id(part.owner) not in inner
            ),
            key=lambda i: self.parts[i].start,
        )
        out, at = [], 0
        for i in order:
            part = self.parts[i]
            out.append(self.text[at : part.start])
            links = alignments[i] if alignments is not None else None
            rendered = self._render(part, translations[i], links, raws)
            if rendered != self.text[part.start : part.end]:  # beside the page's own spans
                after = self.text[part.end : part.end + 1]
                rendered = spans_apart(out[-1], rendered) + rendered + spans_apart(rendered, after)
            out.append(rendered)
            at = part.end
        out.append(self.text[at:])
        return "".join(out)

    def _render(self, part, translation, links, raws=None):
        if translation == part.text and not any(id(tag) in (raws or ()) for _, tag in part.tags):
            return self.text[part.start : part.end]  # as written
        escape = part.escape or self.escape
        return place_tags(part.text, part.tags, translation, links, self.text, escape, raws)


def html_document(page, language="en", split_long=None):
    """The `HtmlDocument` of `page` (a string of HTML); `split_long`: as `run_sentences`'."""
    parts = []
    run = []  # the text and inline tag tokens of the current run
    skipping = []  # open elements whose contents stay as they are
    kept = None  # an inline element kept whole: the run goes on around it
    for token in HtmlTokenizer(page).tokens():
        if skipping:
            if token.kind == "open" and token.tag == skipping[-1]:
                skipping.append(token.tag)
            elif token.kind == "close" and token.tag in skipping:
                del skipping[skipping.index(token.tag) :]
                if not skipping and kept is not None:
                    run.append(MarkupToken("void", kept.start, token.end))
                    kept = None
            continue
        if token.kind == "open" and (token.tag in UNTRANSLATED or token.untranslated):
            if token.tag in KEPT_INLINE and token.tag not in VOID:
                kept = token  # `Run <code>make</code> now.` stays one sentence
            else:
                parts.extend(run_sentences(run, page, language, split_long))
                run = []
            if token.tag not in VOID:
                skipping.append(token.tag)
            elif token.tag in KEPT_INLINE:
                run.append(MarkupToken("void", token.start, token.end))
            continue
        if token.kind in ("open", "void"):
            parts.extend(_attribute_sentences(token, page, language, split_long))
        if token.kind == "text" or (token.kind != "other" and token.tag in INLINE):
            run.append(token)
            continue
        parts.extend(run_sentences(run, page, language, split_long))
        run = []
    if kept is not None:  # never closed: what follows it stays as it is
        run.append(MarkupToken("void", kept.start, len(page)))
    parts.extend(run_sentences(run, page, language, split_long))
    return HtmlDocument(page, parts)


def _attribute_sentences(token, page, language, split_long):
    """The sentences of a tag's `TRANSLATED_ATTRIBUTES` values (and a button's
    `value`, a description's `content`), each its own run of text, whose
    translations go back escaped for the value's quotes."""
    found = []
    matches = list(_ATTRIBUTE.finditer(page, token.start, token.end))
    values = {m.group(1).lower(): (m.group(3) or m.group(4) or "").strip().lower() for m in matches}
    translated = set(TRANSLATED_ATTRIBUTES)
    if token.tag == "input" and values.get("type") in BUTTON_TYPES:
        translated.add("value")
    if token.tag == "meta" and DESCRIPTIONS & {values.get("name"), values.get("property")}:
        translated.add("content")
    for match in matches:
        if match.group(1).lower() not in translated:
            continue
        quote = match.group(2) or ""
        group = 3 if match.group(2) else 4
        start, end = match.start(group), match.end(group)
        run = []
        at = start
        for entity in _ENTITY_REF.finditer(page, start, end):
            if entity.start() > at:
                run.append(MarkupToken("text", at, entity.start(), text=page[at : entity.start()]))
            run.append(
                MarkupToken(
                    "text", entity.start(), entity.end(), text=html.unescape(entity.group())
                )
            )
            at = entity.end()
        if end > at:
            run.append(MarkupToken("text", at, end, text=page[at:end]))
        sentences = run_sentences(run, page, language, split_long)
        for sentence in sentences:
            sentence.escape, sentence.owner = _attribute_escape(quote), token
        found.extend(sentences)
    return found


def _attribute_escape(quote):
    """How a translation goes into an attribute value quoted by `quote` ("" for an
    unquoted value, which is quoted now: the translation may hold spaces)."""

    def escape(text):
        text = html.escape(text, quote=False)
        if quote == "'":
            return text.replace("'", "&#x27;")
        text = text.replace('"', "&quot;")
        return text if quote else f'"{text}"'

    return escape


def run_sentences(run, page, language, split_long=None):
    """The `_Sentence`s of a run of text and inline tag tokens; `split_long`, when
    given, is `(count_tokens, limit)` (`documents.Document.split_long`)."""
    plain, starts, ends, tags = [], [], [], []
    for token in run:
        if token.kind != "text":
            if (
                token.kind == "open"
                and tags
                and tags[-1][0] == len(plain)
                and tags[-1][1].kind == "close"
                and plain
                and not plain[-1].isspace()
            ):
                # Sibling elements with no space between (`<a>Home</a><a>Docs</a>`,
                # spaced by style sheets): a word break for the model, which no
                # page offset holds (a sentence given back unchanged stays as
                # written; `_Sentence.text` is what the model reads).
                plain.append(" ")
                starts.append(token.start)
                ends.append(token.start)
            tags.append((len(plain), token))
            continue
        raw = page[token.start : token.end]
        if token.text == raw:
            plain.extend(raw)
            starts.extend(range(token.start, token.end))
            ends.extend(range(token.start + 1, token.end + 1))
        else:  # an entity: its characters stand for all of it
            plain.extend(token.text)
            starts.extend([token.start] * len(token.text))
            ends.extend([token.end] * len(token.text))
    text = "".join(plain).replace("\n", " ")  # a run's line breaks are spaces in HTML
    spans = sentence_spans(text, language)
    if split_long is not None:
        spans = Document(text, spans).split_long(*split_long).spans
    found = []
    for k, (start, end) in enumerate(spans):
        first, last = starts[start], ends[end - 1]
        inside = [(p - start, t) for p, t in tags if first < t.start < last]
        # A tag pair cut by the sentence's edge: its other half, just outside, comes
        # in with the tags between (`<b>Hund</b>`'s `</b>` after the last word).
        before = spans[k - 1][1] if k else 0
        after = spans[k + 1][0] if k + 1 < len(spans) else len(plain)
        left = [t for p, t in tags if before <= p <= start and t.end <= first]
        right = [t for p, t in tags if end <= p <= after and t.start >= last]
        opened, closed = _unmatched([t for _, t in inside])
        for i, token in enumerate(right):  # up to the close of the outermost open inside
            if token.kind == "close" and opened.get(token.tag):
                opened[token.tag] -= 1
                if not any(opened.values()):
                    inside += [(end - start, t) for t in right[: i + 1]]
                    last = token.end
                    break
        for i in range(len(left) - 1, -1, -1):  # from the open of the outermost close
            if left[i].kind == "open" and closed.get(left[i].tag):
                closed[left[i].tag] -= 1
                if not any(closed.values()):
                    inside = [(0, t) for t in left[i:]] + inside
                    first = left[i].start
                    break
        # A reference link whose label is its text (`[Hund][]`), closed just after the
        # sentence: its close goes out with the sentence, written `][Hund]`.
        held = {id(t) for _, t in inside}
        after_end = [t for p, t in tags if p == end and t.start >= last and id(t) not in held]
        for i, token in enumerate(after_end):
            if token.kind == "close" and token.written:
                inside += [(end - start, t) for t in after_end[: i + 1]]
                last = token.end
                break
        found.append(_Sentence(first, last, "".join(plain[start:end]), inside))
    return found


def _unmatched(tokens):
    """Per tag name, the opening tags of `tokens` that no closing tag in them closes,
    and the closing tags that close none of them: `(opened, closed)` counts."""
    stack, closed = [], {}
    for token in tokens:
        if token.kind == "open":
            stack.append(token.tag)
        elif token.kind == "close":
            if token.tag in stack:
                while stack.pop() != token.tag:
                    pass
            else:
                closed[token.tag] = closed.get(token.tag, 0) + 1
    opened = {}
    for tag in stack:
        opened[tag] = opened.get(tag, 0) + 1
    return opened, closed
