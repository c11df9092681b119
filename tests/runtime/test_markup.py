"""HTML documents: what is translated, what is kept byte for byte, and where inline
tags go (the translated ones, on the toy pair, in test_documents.py)."""

import html.parser
import random

import pytest
from keras_transformer_runtime.documents import parse_document
from keras_transformer_runtime.markup import html_document
from keras_transformer_runtime.tag_placement import place_tags

PAGE = (
    "<!DOCTYPE html>\n<html lang=de><head><meta charset='utf-8'><title>Ein Test</title>"
    "<style>p > b { color: red }</style></head>\n<body>\n"
    '<p class="intro" id=x data-n="1">Ein <b>großer</b> Hund l&auml;uft. Eine '
    "<a href=\"/k?a=1&amp;b=2\" title='Katze'>kleine <i>Katze</i></a> schläft.</p>\r\n"
    '<pre>nicht übersetzen</pre><p translate="no">Auch <b>nicht</b>.</p>'
    '<div class="x notranslate">Nein.</div>'
    "<script>if (a < b && c) { s = '</p>'; }</script><!-- ein Kommentar -->"
    '<![CDATA[x < y]]><p>Zeile<br>zwei <img src=x.png alt="Bild"> Ende &#8211; gut.</p>'
    "<code>x = 1</code><p><b>Fett. Auch fett.</b></p>\n</body></html>\n"
)


def test_only_text_outside_code_and_translate_no_is_read_as_sentences():
    document = html_document(PAGE, "de")
    assert document.sentences == [
        "Ein Test",
        "Katze",  # the link's title
        "Ein großer Hund läuft.",
        "Eine kleine Katze schläft.",
        "Zeile",
        "Bild",  # the image's alt
        "zwei  Ende – gut.",
        "Fett.",
        "Auch fett.",
    ]
    assert document.tagged == [False, False, True, True, False, False, True, False, False]


HARD = [
    PAGE,
    "",
    "no tags at all. Two sentences.",
    "<p>unclosed <b>bold <i>and italic</p> text after",
    "<b><i>crossed</b></i> nesting. <p>a</div></span>b</p>",
    "<p>&amp;&lt;&gt;&quot;&nbsp;&bogus; &#x41;&#65; &#xZZ;</p>",
    "<p title='a > b'>x</p><p>a <!-- mid --> b</p><p>a<?pi x?>b</p>",
    "<table><tr><td>Eins.</td><td>Zwei</td></tr></table><ul><li>Ein <em>Punkt</em></li></ul>",
    "<p>\r\n  indented\r\n  lines.  </p>\r\n",
    "<script>never closed <b>x</b>",
    "<p>lone \ud800 surrogate.</p>",
]


@pytest.mark.parametrize("page", HARD)
def test_a_page_with_nothing_translated_comes_back_byte_for_byte(page):
    document = parse_document(page, "html", "de")
    assert document.rebuild(document.sentences) == page


def test_ten_thousand_nodes_and_malformed_pages_give_valid_output():
    rng = random.Random(0)
    tags = ["b", "i", "a", "span", "p", "div", "em", "li", "td"]
    pieces = []
    for _ in range(10_000):
        tag = rng.choice(tags)
        pieces.append(rng.choice([f"<{tag}>", f"</{tag}>", "Wort. ", "noch eins ", "&amp; "]))
    page = "".join(pieces)
    document = html_document(page, "de")
    assert document.rebuild(document.sentences) == page
    translated = document.rebuild([s.upper() for s in document.sentences])
    # Every tag of the page is in the output, as written: none dropped, none added.
    assert sorted(_tags(translated), key=repr) == sorted(_tags(page), key=repr)


def _tags(page):
    found = []

    class Tags(html.parser.HTMLParser):
        def handle_starttag(self, tag, attrs):
            found.append((tag, attrs))

        def handle_endtag(self, tag):
            found.append(("/" + tag,))

    Tags().feed(page)
    return found


def _page(tokens):
    """Tag tokens as place_tags takes them, from (position, raw tag) pairs."""
    from keras_transformer_runtime.markup import HtmlTokenizer

    page = "".join(raw for _, raw in tokens)
    found = HtmlTokenizer(page).tokens()
    return page, [(position, token) for (position, _), token in zip(tokens, found, strict=True)]


def test_inline_tags_wrap_the_target_words_aligned_to_their_source_words():
    source = "ein großer Hund"
    page, tags = _page([(4, "<b>"), (10, "</b>")])
    # "a big dog": ein->a, großer->big, Hund->dog
    links = [(0, 0), (1, 1), (2, 2)]
    assert place_tags(source, tags, "a big dog", links, page) == "a <b>big</b> dog"
    # Reordered, and one source word into two target words.
    links = [(0, 2), (1, 0), (1, 1), (2, 3)]
    assert place_tags(source, tags, "very big a dog", links, page) == "<b>very big</b> a dog"
    # Aligned to nothing: kept, empty, at the nearer end of the sentence.
    assert place_tags(source, tags, "a big dog", [(0, 0), (2, 1)], page) == "<b></b>a big dog"
    page, late = _page([(11, "<b>"), (15, "</b>")])
    assert place_tags(source, late, "a big dog", [(0, 0), (1, 2)], page) == "a big dog<b></b>"
    # Unlinked, but the words between its neighbours' are few: they are taken.
    assert place_tags(source, late, "a big dog", [(0, 0), (1, 1)], page) == "a big <b>dog</b>"
    assert place_tags(source, tags, "x & y", None, page) == "<b></b>x &amp; y"


def test_nested_tags_stay_nested_and_siblings_do_not_cross():
    source = "eine kleine Katze schläft"
    page, tags = _page([(5, '<a href="k">'), (12, "<i>"), (17, "</i>"), (17, "</a>")])
    links = [(0, 0), (1, 1), (2, 2), (3, 3)]
    found = place_tags(source, tags, "a small cat sleeps", links, page)
    assert found == 'a <a href="k">small <i>cat</i></a> sleeps'
    # Reordered: the parent spans its words' extent, the child its own word.
    links = [(0, 0), (1, 1), (2, 3), (3, 2)]
    found = place_tags(source, tags, "a small sleeps cat", links, page)
    assert found == 'a <a href="k">small sleeps <i>cat</i></a>'
    # A child aligned outside its parent is kept inside it.
    links = [(0, 0), (1, 1), (2, 0), (3, 2)]
    found = place_tags(source, tags, "a small sleeps", links, page)
    assert found.index("<a") < found.index("<i>") < found.index("</i>") < found.index("</a>")
    # Two siblings aligned to one target word: the second does not cross the first,
    # nor go inside it; kept empty, it follows it.
    page, tags = _page([(0, "<b>"), (4, "</b>"), (5, "<i>"), (11, "</i>")])
    found = place_tags("eine kleine Katze", tags, "kitten", [(0, 0), (1, 0), (2, 0)], page)
    assert found == "<b>kitten</b><i></i>"
    # A child kept empty goes first inside its parent.
    page, tags = _page([(0, "<a>"), (5, "<b>"), (11, "</b>"), (17, "</a>")])
    links = [(0, 0), (2, 1)]  # "kleine", wrapped by <b>, links to no target word
    assert place_tags("eine kleine Katze", tags, "a cat", links, page) == "<a><b></b>a cat</a>"


def test_sibling_elements_with_no_space_between_are_separate_words():
    """`<a>Home</a><a>Docs</a>`, spaced by a style sheet: the model reads two words, each
    element wraps its own, and a sentence given back unchanged stays as written."""
    page = '<p><a href="/">Ein Hund</a><span class="v">läuft schnell</span></p>'
    document = html_document(page, "de")
    assert document.sentences == ["Ein Hund läuft schnell"]
    assert document.rebuild(document.sentences) == page
    links = [[(0, 0), (1, 1), (2, 2), (3, 3)]]
    found = document.rebuild(["A dog runs fast"], links)
    assert found == '<p><a href="/">A dog</a> <span class="v">runs fast</span></p>'
    # Inside a word, the markup is not a boundary.
    assert html_document("<p><b>W</b>ort und Hun<i>d</i></p>", "de").sentences == ["Wort und Hund"]


MARKDOWN = """# Ein **Titel**

Ein *großer* Hund \\*läuft\\* über [die *grüne* Wiese](http://x.de/a_b "T") &amp; `code *x*` hier.
Zweite Zeile mit <b>html</b> und ![Bild *a*](a.png) und <http://auto.link>.

- Punkt eins.
- Punkt __zwei__. Und [ref][r] da.
  1. Verschachtelt.

> Zitat. Noch
> eins.

```python
x = 1  # nicht übersetzen
```

| A | B |
|---|---|
| Eins. | Zwei ~~drei~~ |

    eingerückt, nicht übersetzen

<div>
HTML-Block, nicht übersetzen
</div>

[r]: http://r.de "Ref"
"""


def test_markup_of_real_pages_keeps_its_structure():
    """Shapes found on real documentation pages: elements that open before a sentence
    and close inside it stay nested (two of one name: `<span><span>1.8</span> ·
    <a>Quelle</a></span>`); a link around inline code alone goes whole, the code in
    it; a `<wbr>` inside a word the translation copies stays at its place, and one
    in a word it does not stays inside its element."""
    page = (
        '<div><span class="r"><span class="s">1.8</span> · <a class="q" href="x">Quelle</a>'
        '</span><a href="#i">§</a></div>'
    )
    document = html_document(page, "de")
    assert document.sentences == ["1.8 · Quelle §"]
    found = document.rebuild(["1.8 · source §"], [[(0, 0), (1, 1), (2, 2), (3, 3)]])
    assert found == (
        '<div><span class="r"><span class="s">1.8</span> · <a class="q" href="x">source</a>'
        '</span> <a href="#i">§</a></div>'
    )
    page = '<p>Die <a href="d"><code>regex</code></a> Doku, <code>Cargo.toml</code> hier.</p>'
    document = html_document(page, "de")
    assert document.sentences == ["Die  Doku,  hier."]
    found = document.rebuild(["The docs, here."], [[(0, 0), (1, 1), (2, 2)]])
    assert (
        found == '<p>The <a href="d"><code>regex</code></a> docs, <code>Cargo.toml</code> here.</p>'
    )
    page = '<h2><a href="i">In core::<wbr>arch::<wbr>x86</a></h2>'
    document = html_document(page, "de")
    found = document.rebuild(["At core::arch::x86"], [[(0, 0), (1, 1)]])
    assert found == '<h2><a href="i">At core::<wbr>arch::<wbr>x86</a></h2>'
    found = document.rebuild(["Im Kern"], [[(0, 0)]])
    assert found == '<h2><a href="i">Im Kern<wbr><wbr></a></h2>'


def test_markdown_of_real_files_keeps_its_links_and_code():
    """Two code spans that land side by side stay two; a reference link whose text is
    its label (`[Policies][]`, `[Policies]`) keeps the label when its text is
    translated; a link around code alone does not go inside another link."""
    page = "Mit `make` und `gdb` [Hilfe][] und [Regeln] oder [`api`][] hier.\n\n"
    page += "[Hilfe]: h.md\n[Regeln]: r.md\n[`api`]: a.md\n"
    document = parse_document(page, "markdown", "de")
    assert document.sentences == ["Mit  und  Hilfe und Regeln oder  hier."]
    # Every word to the first target word: all the code lands together.
    found = document.rebuild(["Help rules here."], [[(i, 0) for i in range(7)]])
    assert "`make` `gdb`" in found
    assert "[Help][Hilfe]" in found and "][Regeln]" in found and "[`api`][`api`]" in found
    assert found.count("[") == found.count("]")
    assert found.endswith("[Hilfe]: h.md\n[Regeln]: r.md\n[`api`]: a.md\n")
    assert "[[" not in found  # no link inside a link
    # The whole cell a reference link, and a code span just before a sentence.
    page = "| [Alte Regeln][] | `a`, `b`: gleich |\n| --- | --- |\n\n[Alte Regeln]: r.md\n"
    document = parse_document(page, "markdown", "de")
    assert document.sentences == ["Alte Regeln", ", : gleich"]
    found = document.rebuild(["Old rules", "the same"], [[(0, 0), (1, 1)], [(2, 0)]])
    assert found.startswith("| [Old rules][Alte Regeln] | `a`") and "``" not in found
    found = document.rebuild(["Old rules", "the same"], [[(0, 0), (1, 1)], [(1, 0), (2, 1)]])
    assert "`a` `b`the same" in found  # `b` before "the": kept apart from `a`
    assert document.rebuild(document.sentences) == page


def _identity_links(document):
    return [[(i, i) for i in range(len(s.split()))] for s in document.sentences]


def test_markdown_text_is_translated_in_context_and_code_and_urls_are_kept():
    document = parse_document(MARKDOWN, "markdown", "de")
    assert document.rebuild(document.sentences) == MARKDOWN
    assert "Ein großer Hund *läuft* über die grüne Wiese &  hier." in document.sentences
    assert "Punkt zwei." in document.sentences and "Zwei drei" in document.sentences
    found = document.rebuild([s.upper() for s in document.sentences], _identity_links(document))
    for kept in (
        "```python\nx = 1  # nicht übersetzen\n```",
        "    eingerückt, nicht übersetzen",
        "<div>\nHTML-Block, nicht übersetzen\n</div>",
        '](http://x.de/a_b "T")',
        "`code *x*` HIER.",
        "![Bild *a*](a.png)",
        "<http://auto.link>",
        '[r]: http://r.de "Ref"',
        "|---|---|",
    ):
        assert kept in found
    assert "# EIN **TITEL**" in found and "PUNKT __ZWEI__." in found
    assert "EIN *GROSSER* HUND \\*LÄUFT\\* ÜBER [DIE *GRÜNE* WIESE](" in found
    assert "| EINS. | ZWEI ~~DREI~~ |" in found


@pytest.mark.parametrize("seed", range(3))
def test_random_markdown_never_raises_and_comes_back_byte_for_byte(seed):
    rng = random.Random(seed)
    pieces = ["*", "**", "_", "`", "[", "](", ")", "\n", "\n\n", "> ", "- ", "# ", "|", "\\"]
    pieces += ["Wort. ", "noch eins ", "&amp; ", "<b>", "</b>", "```\n", "    ", "!["]
    page = "".join(rng.choice(pieces) for _ in range(3000))
    document = parse_document(page, "markdown", "de")
    assert document.rebuild(document.sentences) == page
    document.rebuild([s.upper() for s in document.sentences], _identity_links(document))


@pytest.mark.parametrize(
    ("page", "input_format"),
    [
        ("<p>eins <b>zwei drei vier</b> fünf sechs sieben.</p>", "html"),
        ("eins **zwei drei vier** fünf sechs sieben.\n", "markdown"),
    ],
)
def test_a_sentence_over_the_limit_is_cut_into_pieces_in_markup_too(page, input_format):
    def words(text):
        return len(text.split())

    document = parse_document(page, input_format, "de", split_long=(words, 3))
    assert document.sentences == ["eins zwei drei", "vier fünf sechs", "sieben."]
    assert document.rebuild(document.sentences) == page
    found = document.rebuild([s.upper() for s in document.sentences], _identity_links(document))
    # The pair cut by the pieces' edge comes back whole: each half by its own word.
    expected = {
        "html": "<p>EINS <b>ZWEI DREI VIER</b> FÜNF SECHS SIEBEN.</p>",
        "markdown": "EINS **ZWEI DREI VIER** FÜNF SECHS SIEBEN.\n",
    }
    assert found == expected[input_format]


def test_inline_code_and_translate_no_stay_in_their_sentence_whole():
    page = (
        '<p>Run <code>make <b>all</b></code> now. Ich mag <span translate="no">Foo Bar</span>'
        " sehr.</p><p>Open <code>never closed"
    )
    document = html_document(page, "en")
    assert document.sentences == ["Run  now.", "Ich mag  sehr.", "Open"]
    assert document.rebuild(document.sentences) == page
    found = document.rebuild([s.upper() for s in document.sentences], _identity_links(document))
    assert found.startswith("<p>RUN  <code>make <b>all</b></code> NOW. ICH MAG  <span ")
    assert found.endswith('translate="no">Foo Bar</span> SEHR.</p><p>OPEN <code>never closed')


def test_button_labels_and_page_descriptions_are_translated_other_values_kept():
    page = (
        '<head><meta name="Description" content="Ein Hund.">'
        '<meta property=og:title content=Hunde><meta name=keywords content="Hund, Katze">'
        '<meta charset=utf-8></head><form><input type=SUBMIT value="Senden">'
        '<input type=text value="Hund"><input value=Nein><button>Los</button></form>'
    )
    document = html_document(page, "de")
    assert document.sentences == ["Ein Hund.", "Hunde", "Senden", "Los"]
    assert document.rebuild(document.sentences) == page
    found = document.rebuild([s.upper() for s in document.sentences], _identity_links(document))
    assert found == (
        '<head><meta name="Description" content="EIN HUND.">'
        '<meta property=og:title content="HUNDE"><meta name=keywords content="Hund, Katze">'
        '<meta charset=utf-8></head><form><input type=SUBMIT value="SENDEN">'
        '<input type=text value="Hund"><input value=Nein><button>LOS</button></form>'
    )


def test_alt_title_and_placeholder_values_are_translated_and_stay_valid():
    page = (
        '<p title="Ein Titel. Zwei.">Ein <img src=a.png alt=Bild> und '
        '<a href="x" title=\'Ein "Link"\'>Link</a> hier.</p>'
        '<input placeholder="Name &amp; Ort" value="x"><span translate=no title="nein">x</span>'
    )
    document = html_document(page, "de")
    assert document.rebuild(document.sentences) == page
    found = document.rebuild(
        [s.upper() + " neu" for s in document.sentences], _identity_links(document)
    )
    assert found == (
        '<p title="EIN TITEL. neu ZWEI. neu">EIN  <img src=a.png alt="BILD neu"> UND '
        '<a href="x" title=\'EIN "LINK" neu\'>LINK</a> HIER. neu</p>'
        '<input placeholder="NAME &amp; ORT neu" value="x"><span translate=no title="nein">x</span>'
    )
    assert sorted(_tags(found), key=repr) != sorted(_tags(page), key=repr)  # values changed
    assert [tag for tag, *_ in _tags(found)] == [tag for tag, *_ in _tags(page)]
