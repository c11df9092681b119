"""Inline tags put back into a translation: around the target words aligned to the
source words they wrapped (`place_tags`), from the word links of the alignment
layer's weights (`word_links`, `sentence_links`). `markup` (HTML) and `markdown`
read the documents; this is where their tags go once a sentence is translated
(docs/documents.md has the rules)."""

from __future__ import annotations

import bisect
import dataclasses
import html
import itertools
import re

from keras_transformer_runtime.sources import source_array, teacher_inputs
from keras_transformer_runtime.specials import EOS_ID
from keras_transformer_runtime.text_batches import text_source

WORD = re.compile(r"\S+")


def escape_html(text):
    return html.escape(text, quote=False)


def spans_apart(before, after):
    """A space where `before` ends and `after` starts a Markdown code span (side by side,
    `` `a``b` `` would read as one), else nothing."""
    return " " if before.endswith("`") and after.startswith("`") else ""


def place_tags(source, tags, translation, links, page, escape=None, raws=None):
    """`translation`, HTML-escaped, with the inline `tags` of `source` around the
    target words linked to the source words they wrapped (`links`: (source word,
    target word) pairs, or None). `raws`: tags as rewritten (translated
    attribute values), by `id`."""

    def raw_of(token):
        return (raws or {}).get(id(token)) or token.written or page[token.start : token.end]

    source_words = [m.span() for m in WORD.finditer(source)]
    target_words = [m.span() for m in WORD.finditer(translation)]
    by_source = {}
    for s, t in links or ():
        by_source.setdefault(s, set()).add(t)
    pairs, stack, singles = [], [], []
    for position, token in tags:
        if token.kind == "open":
            stack.append((position, token))
        elif token.kind == "close" and any(t.tag == token.tag for _, t in stack):
            while stack:
                opened, opening = stack.pop()
                if opening.tag == token.tag:
                    parent = id(stack[-1][1]) if stack else None
                    pairs.append((len(stack), opened, position, opening, token, parent))
                    break
                singles.append((opened, opening))
        else:
            singles.append((position, token))
    singles.extend(stack)
    pairs, singles, units = _wordless_units(source_words, tags, pairs, singles, page, raw_of)
    raws = {**(raws or {}), **units}
    inserts = []  # (character position in translation or None: the end, kind, depth, raw tag)
    placed = {}  # id(opening tag) -> (parent, first, last) of the pairs placed
    ends = []  # (parent, source start, start and end in the translation, source end) of pairs
    for depth, opened, closed, opening, closing, parent in sorted(pairs, key=lambda p: p[:2]):
        wrapped = [i for i, (s, e) in enumerate(source_words) if s < closed and e > opened]
        targets = sorted({t for i in wrapped for t in by_source.get(i, ())})
        if not targets and wrapped:  # no target word attends to them most: between
            targets = _between(by_source, wrapped[0], wrapped[-1], len(target_words))
        span = _span(targets, placed, parent) if target_words else None
        raw_open, raw_close = raw_of(opening), raw_of(closing)
        if span is None:  # kept, empty: after its sibling placed before it, else
            # first in its parent, else at the nearer end of the sentence
            before = [e for p, o, _, e, _ in ends if p == parent and o < opened]
            if before:
                at = before[-1]
            elif parent is not None and parent in placed:
                at = target_words[placed[parent][1]][0]
            else:
                at = 0 if opened < len(source) / 2 else None
            inserts.append((at, 0, depth, raw_open + raw_close))
            continue
        placed[id(opening)] = (parent, *span)
        start, end = target_words[span[0]][0], target_words[span[1]][1]
        # Punctuation the tag left outside in its word ("**Hund**.") stays outside.
        lead = _outside(source, source_words, opened, before=True)
        trail = _outside(source, source_words, closed, before=False)
        start += len(lead) if translation.startswith(lead, start) and lead else 0
        end -= len(trail) if trail and translation[:end].endswith(trail) else 0
        inserts.append((start, 0, depth, raw_open))
        inserts.append((max(end, start), 1, depth, raw_close))
        ends.append((parent, opened, start, max(end, start), closed))
    for position, token in singles:
        raw = raw_of(token)
        if token.kind == "close":  # after the target words of the source word before it
            word = bisect.bisect_left([e for _, e in source_words], position + 1) - 1
            targets = sorted(by_source.get(word, ()))
            at = target_words[targets[-1]][1] if targets and target_words else None
            inserts.append((at, 1, 99, raw) if at is not None else _last_in(ends, position, raw))
            continue
        # Inside a word the translation copies (`core::<wbr>arch`): the same place in it.
        within = _copied_at(source, source_words, position, by_source, translation, target_words)
        if within is not None:
            inserts.append((within, 0, 99, raw))
            continue
        # Before the target word of the source word after it; an image or a code
        # span keeps the space after it.
        word = bisect.bisect_left([s for s, _ in source_words], position)
        targets = sorted(by_source.get(word, ()))
        at = target_words[targets[0]][0] if targets and target_words else None
        spaced = token.kind == "void" and position < len(source) and source[position].isspace()
        if at is None:
            inserts.append(_last_in(ends, position, raw))
            continue
        inserts.append(_settled(ends, position, at, raw + (" " if spaced else "")))
    return _insert(translation, inserts, escape or escape_html)


def _wordless_units(source_words, tags, pairs, singles, page, raw_of):
    """Pairs around no word (`<a><code>x</code></a>`, `<span> </span>`), each with all it
    holds as it is written, become one lone tag that goes where a tag at its place
    would: `(pairs, singles, raws)`, the units' raw text in `raws` by `id`."""
    order = {id(token): k for k, (_, token) in enumerate(tags)}
    units = []
    for pair in sorted(pairs, key=lambda p: p[0]):  # the outermost first
        _, opened, closed, opening, closing, _ = pair
        if any(start < closed and end > opened for start, end in source_words):
            continue
        first, last = order[id(opening)], order[id(closing)]
        if not any(low <= first and last <= high for low, high, _ in units):
            units.append((first, last, pair))
    if not units:
        return pairs, singles, {}

    def held(token):
        return any(low <= order[id(token)] <= high for low, high, _ in units)

    pairs = [pair for pair in pairs if not held(pair[3])]
    singles = [(position, token) for position, token in singles if not held(token)]
    raws = {}
    for first, last, (_, opened, _, opening, closing, _) in units:
        held_tokens = [token for _, token in tags[first : last + 1]]
        raw = "".join(
            raw_of(token) + page[token.end : after.start]
            for token, after in itertools.pairwise(held_tokens)
        )
        unit = dataclasses.replace(opening, kind="void", end=closing.end, written="")
        raws[id(unit)] = raw + raw_of(closing)
        singles.append((opened, unit))
    singles.sort(key=lambda single: single[0])
    return pairs, singles, raws


def _copied_at(source, source_words, position, by_source, translation, target_words):
    """Where in the translation a tag at `position`, strictly inside a source word, goes:
    the same offset in a target word linked to that word and spelled the same (an
    identifier or a name the model copied), else None."""
    for i, (start, end) in enumerate(source_words):
        if start < position < end:
            for t in sorted(by_source.get(i, ())):
                t_start, t_end = target_words[t]
                if translation[t_start:t_end] == source[start:end]:
                    return t_start + position - start
            return None
    return None


def _settled(ends, position, at, raw):
    """The insert of a lone tag at `at`, kept in the pairs that held it in the source
    (`position`) and out of the others: one it would fall inside, it follows."""
    for _ in ends:  # each move passes one pair at most
        moved = False
        for _, opened, start, end, closed in ends:
            held = opened < position < closed
            if held and not start <= at <= end:
                return _last_in(ends, position, raw)  # last inside the innermost holder
            if not held and start <= at < end and start < end:
                at, moved = end, True
        if not moved:
            break
    return (at, 0, 99, raw)


def _last_in(ends, position, raw):
    """The insert of a lone tag whose word links to nothing: last inside the innermost
    pair placed around it in the source (before that pair's closing tag), else at the
    sentence's end."""
    around = [(opened, end) for _, opened, _, end, closed in ends if opened < position < closed]
    if around:
        return (max(around)[1], 2, 0, raw)
    return (None, 0, 99, raw)


def _between(by_source, first, last, count):
    """The target words strictly between those of the nearest linked source words
    before `first` and after `last` (the sentence's ends where there are none), or
    [] when that leaves none or too many to be a guess (more than 3)."""
    if not by_source:
        return []
    left = max((max(by_source[i]) for i in by_source if i < first), default=-1)
    right = min((min(by_source[i]) for i in by_source if i > last), default=count)
    return list(range(left + 1, right)) if 0 < right - left - 1 <= 3 else []


def _outside(source, words, position, before):
    """The punctuation between `position` (inside a word) and that word's start
    (`before`) or end, when that is all punctuation; else ""."""
    for start, end in words:
        if start < position < end:
            piece = source[start:position] if before else source[position:end]
            return piece if not any(c.isalnum() for c in piece) else ""
    return ""


def _span(targets, placed, parent):
    """The (first, last) target words of a tag pair: its aligned words' extent, kept
    inside its parent's and clear of its siblings placed before it; None if none fit."""
    if not targets:
        return None
    first, last = targets[0], targets[-1]
    if parent is not None:
        if parent not in placed:
            return None
        first, last = max(first, placed[parent][1]), min(last, placed[parent][2])
    for sibling_parent, sibling_first, sibling_last in placed.values():
        if sibling_parent == parent and not (last < sibling_first or first > sibling_last):
            first = sibling_last + 1
    return (first, last) if first <= last else None


def _insert(translation, inserts, escape):
    """`translation` escaped, with the raw tags of `inserts` put in at their positions:
    at one position, lone tags kept inside the pair closing there (kind 2) first, then
    closing tags (inner first), then opening ones (outer first). Two Markdown code
    spans that land side by side keep a space between them (`` `a``b` `` is one)."""
    end = len(translation)
    resolved = [(end if at is None else at, kind, depth, raw) for at, kind, depth, raw in inserts]
    resolved.sort(key=lambda item: (item[0], -item[1], -item[2] if item[1] else item[2]))
    out, at = [], 0
    for position, _, _, raw in resolved:
        text = escape(translation[at:position])
        out.append(text or spans_apart(out[-1] if out else "", raw))
        out.append(raw)
        at = position
    out.append(escape(translation[at:]))
    return "".join(out)


def word_links(source_text, target_ids, weights, encode, decode):
    """(source word, target word) links of a sentence and its translation, from the
    alignment layer's weights `(target tokens, source tokens)` (EOS left out): each
    target word to the source words its tokens attend to most, and each source
    word that none attends to most to the target word that attends to it most."""
    source_words = list(WORD.finditer(source_text))
    if not source_words or not len(target_ids) or not weights.size:
        return []
    bounds = [len(encode(source_text[: m.end()])) for m in source_words]

    last = len(source_words) - 1
    word_of = [min(bisect.bisect_right(bounds, p), last) for p in range(weights.shape[1])]
    target_word = [len(decode(target_ids[: j + 1]).split()) - 1 for j in range(len(target_ids))]
    links = set()
    for j, row in enumerate(weights):
        if target_word[j] >= 0:
            links.add((word_of[int(row.argmax())], target_word[j]))
    linked = {s for s, _ in links}
    for word in range(len(source_words)):
        if word in linked:
            continue
        columns = [p for p, owner in enumerate(word_of) if owner == word]
        if columns:
            j = int(weights[:, columns].max(axis=1).argmax())
            if target_word[j] >= 0:
                links.add((word, target_word[j]))
    return sorted(links)


def sentence_links(translator, sentences, targets, sources=None, weights=None):
    """Per sentence (a text), the `(source word, target word)` links of `targets[i]`
    (token ids) as its translation by `translator` (a `translator.Translator`):
    `word_links` of the alignment layer's weights, `weights[i]` where given (a
    search's rows, `(steps, source_len)`), else `Decoder.alignment_weights`' in
    one pass for the others. `sources`: the sentences' source ids, when the
    caller has them (a batch just searched)."""
    if not sentences:
        return []
    if len(targets) != len(sentences):
        raise ValueError(f"{len(targets)} translations for {len(sentences)} sentences.")
    tokenizer, decoder = translator.tokenizer, translator.decoder
    if sources is None:
        sources = [text_source(text, tokenizer.encode)[0] for text in sentences]
    sources = [list(source) or [EOS_ID] for source in sources]
    targets = [[int(t) for t in target] for target in targets]
    weights = list(weights) if weights is not None else [None] * len(sentences)
    missing = [i for i, rows in enumerate(weights) if rows is None]
    if missing:
        source, _ = source_array(
            [sources[i] for i in missing], translator.max_length, decoder.source_multiple
        )
        forced = decoder.alignment_weights(source, teacher_inputs([targets[i] for i in missing]))
        for i, rows in zip(missing, forced, strict=True):
            weights[i] = rows
    return [
        word_links(
            text, target, rows[: len(target), : len(source) - 1], tokenizer.encode, tokenizer.decode
        )
        for text, target, rows, source in zip(sentences, targets, weights, sources, strict=True)
    ]
