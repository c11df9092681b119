"""Markdown documents: the text of paragraphs, headings, list items, quotes and table
cells translated in context, everything else kept as written.

markdown-it-py (CommonMark, with tables and strikethrough) finds the blocks
and, within each, the inline structure: emphasis, links, code spans,
images, inline HTML. This module finds each of those in the source, so
that the page is rebuilt from the source itself, as `markup.HtmlDocument`
rebuilds HTML: code blocks, fences, HTML blocks, link destinations and
titles, code spans, images and autolinks are copied as written; the text of
an inline run (a paragraph, a heading, a cell), emphasis and link text
included, is split into sentences and translated in context; emphasis
markers and link brackets go back around the aligned target words
(`tag_placement.place_tags`). Where the source cannot be matched to what the
parser read (it should not happen), that block is left untranslated:
nothing is lost.
"""

from __future__ import annotations

import html
import re

from keras_transformer_runtime.markup import HtmlDocument, MarkupToken, run_sentences

_ENTITY = re.compile(r"&(#[0-9]{1,7}|#[xX][0-9a-fA-F]{1,6}|[A-Za-z][A-Za-z0-9]{1,31});")
_LINK_TAIL = re.compile(
    r"\]\(\s*(?:<[^<>\n]*>|(?:[^()\s\\]|\\.|\([^()\s]*\))*)"
    r"(?:\s+(?:\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|\((?:[^()\\]|\\.)*\)))?\s*\)"
    r"|\]\[(?:[^\[\]\\]|\\.)*\]|\]"
)
_LINK_OPEN = re.compile(r"\[")
_HTML_TAG = re.compile(r"<\s*(/?)\s*([A-Za-z][A-Za-z0-9-]*)")
_PAIRS = {"strong", "em", "s", "link"}


class _Unmatched(Exception):
    """The source does not read as the parser's tokens say: leave the block as it is."""


def _escape_markdown(text):
    """A translation's text as Markdown: the characters that would start markup escaped."""
    return re.sub(r"([\\`*_\[\]<>|])", r"\\\1", text)


def markdown_document(page, language="en", split_long=None):
    """The `markup.HtmlDocument` of a Markdown `page`, rebuilt with Markdown escapes."""
    from markdown_it import MarkdownIt

    parser = MarkdownIt("commonmark").enable("table").enable("strikethrough")
    lines = page.split("\n")
    line_starts = [0]
    for line in lines[:-1]:
        line_starts.append(line_starts[-1] + len(line) + 1)
    parts = []
    cursor_line, cursor_column = -1, 0  # table cells share a line: search on from the last
    for block in parser.parse(page):
        if block.type != "inline" or block.map is None or not block.content.strip():
            continue
        first_line = block.map[0]
        if first_line != cursor_line:
            cursor_line, cursor_column = first_line, 0
        try:
            offsets, cursor_column = _content_offsets(
                block.content, lines, line_starts, first_line, cursor_column
            )
            tokens = _inline_tokens(block.children, block.content, offsets, page)
        except _Unmatched:
            continue
        parts.extend(run_sentences(tokens, page, language, split_long))
    return HtmlDocument(page, parts, _escape_markdown)


def _content_offsets(content, lines, line_starts, first_line, column):
    """The page offset of each character of an inline block's `content` (its lines
    as the parser read them, container markers and indentation left out), and
    where on its first line the content ended."""
    offsets = []
    end_column = column
    for k, piece in enumerate(content.split("\n")):
        number = first_line + k
        if number >= len(lines):
            raise _Unmatched
        at = lines[number].find(piece, column if k == 0 else 0)
        if at < 0:
            raise _Unmatched
        if k:
            offsets.append(line_starts[number] - 1)  # the line break before this line
        offsets.extend(range(line_starts[number] + at, line_starts[number] + at + len(piece)))
        if k == 0:
            end_column = at + len(piece)
    return offsets, end_column


def _inline_tokens(children, content, offsets, page):
    """`markup.MarkupToken`s of an inline block, at their page offsets."""
    tokens = []
    i = 0  # the position in `content`
    end = len(content)

    def page_span(start, stop):
        return offsets[start], (offsets[stop - 1] + 1 if stop > start else offsets[start])

    def add(kind, start, stop, tag="", text=""):
        if stop > start:
            first, last = page_span(start, stop)
            tokens.append(MarkupToken(kind, first, last, tag, text))

    def text_run(expected):
        nonlocal i
        j = 0
        while j < len(expected):
            if i >= end:
                raise _Unmatched
            char = content[i]
            entity = _ENTITY.match(content, i) if char == "&" else None
            if entity and expected.startswith(html.unescape(entity.group()), j):
                decoded = html.unescape(entity.group())
                add("text", i, entity.end(), text=decoded)
                i, j = entity.end(), j + len(decoded)
            elif char == "\\" and i + 1 < end and content[i + 1] == expected[j] != "\\":
                add("text", i, i + 2, text=expected[j])
                i, j = i + 2, j + 1
            elif char == expected[j]:
                add("text", i, i + 1, text=char)
                i, j = i + 1, j + 1
            elif char.isspace():  # spaces the parser dropped (before a line break)
                add("text", i, i + 1, text=char)
                i += 1
            else:
                raise _Unmatched

    skip_until = None
    links = []  # where each open link's `[` is in `content`
    for child in children:
        if skip_until is not None:  # the inside of an autolink, copied whole
            if child is skip_until:
                skip_until = None
            continue
        kind = child.type
        if kind == "text":
            text_run(child.content)
        elif kind in ("softbreak", "hardbreak"):
            start = i
            while i < end and content[i] in " \t\\":
                i += 1
            if i >= end or content[i] != "\n":
                raise _Unmatched
            i += 1
            add("text", start, i, text=" " if kind == "softbreak" else "\n")
        elif kind.endswith("_open") or kind.endswith("_close"):
            name = kind.rsplit("_", 1)[0]
            if name == "link" and child.markup == "autolink":
                stop = content.find(">", i)
                if not content.startswith("<", i) or stop < 0:
                    raise _Unmatched
                add("void", i, stop + 1)
                i = stop + 1
                skip_until = _closing(children, child)
                continue
            if name not in _PAIRS:
                raise _Unmatched
            if name == "link":
                pattern = _LINK_OPEN if kind.endswith("open") else _LINK_TAIL
                match = pattern.match(content, i)
            else:
                match = re.compile(re.escape(child.markup)).match(content, i)
            if match is None:
                raise _Unmatched
            add("open" if kind.endswith("open") else "close", i, match.end(), tag=name)
            if name == "link" and kind.endswith("open"):
                links.append(i)
            elif name == "link" and links:
                opened = links.pop()
                if match.group() in ("]", "][]"):  # the text is the reference's label:
                    # a translated text keeps the label (`[Hund][]` -> `[dog][Hund]`)
                    tokens[-1].written = "][" + content[opened + 1 : i] + "]"
            i = match.end()
        elif kind == "code_inline":
            fence = re.match(r"`+", content[i:])
            if fence is None:
                raise _Unmatched
            stop = content.find(fence.group(), i + len(fence.group()))
            if stop < 0:
                raise _Unmatched
            add("void", i, stop + len(fence.group()))
            i = stop + len(fence.group())
        elif kind == "image":
            start = i
            if not content.startswith("![", i):
                raise _Unmatched
            depth, i = 1, i + 2
            while i < end and depth:
                if content[i] == "\\":
                    i += 1
                elif content[i] == "[":
                    depth += 1
                elif content[i] == "]":
                    depth -= 1
                    if not depth:
                        break
                i += 1
            tail = _LINK_TAIL.match(content, i)
            if tail is None:
                raise _Unmatched
            add("void", start, tail.end())
            i = tail.end()
        elif kind == "html_inline":
            if not content.startswith(child.content, i):
                raise _Unmatched
            tag = _HTML_TAG.match(child.content)
            stop = i + len(child.content)
            if tag is None or child.content.endswith("/>"):
                add("void", i, stop)
            else:
                add("close" if tag.group(1) else "open", i, stop, tag=tag.group(2).lower())
            i = stop
        else:
            raise _Unmatched
    return tokens


def _closing(children, opening):
    """The link_close after `opening` in `children`."""
    after = False
    for child in children:
        if child is opening:
            after = True
        elif after and child.type == "link_close":
            return child
    raise _Unmatched
