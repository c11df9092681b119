"""Texts in, results out, in order: tokenizing, sorting by length into batches, warnings.

`search_texts` is how every text-level call of `translator.Translator`
(translate, n-best, scoring) batches its input. Needs numpy only.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np

from keras_transformer_runtime.progress import Progress
from keras_transformer_runtime.sources import check_positive_int
from keras_transformer_runtime.spec import truncate_source
from keras_transformer_runtime.specials import EOS_ID, UNK_ID


def text_source(text, encode, max_input_length=None):
    """`(ids, length)`: a text's source ids, `encode(text) + [EOS]` (none for an empty or
    whitespace-only text), cut to `max_input_length` (`spec.truncate_source`), and
    their length before the cut."""
    ids = encode(text) if text.strip() else []
    ids = ids + [EOS_ID] if ids else []
    return truncate_source(ids, max_input_length), len(ids)


def search_texts(
    texts,
    encode,
    search,
    model_max_length,
    batch_size=32,
    progress=False,
    warn=None,
    parallel_batches=1,
    max_input_length=None,
):
    """Searches strings in batches with `search(sources, indices) -> results`, in order.

    Each text becomes its `text_source`; texts are sorted by length into batches, so
    padding stays small, and the results (one per text, whatever `search`
    returns for it) are put back in input order. `indices` are the texts'
    places in `texts`. A text longer than `model_max_length` (the positions
    the model trained on) is searched whole, and `warn(message)`, when
    given, hears of it (and of every truncated text) before the search
    and their count after it.

    `parallel_batches` > 1 searches that many batches at once, each on its
    own thread, so `search` must then be safe to call from several threads.
    """
    check_positive_int("batch_size", batch_size)
    check_positive_int("parallel_batches", parallel_batches)
    sources = []
    truncated = []
    for i, text in enumerate(texts):
        ids, length = text_source(text, encode, max_input_length)
        if length > len(ids):
            truncated.append(i)
            if warn is not None:
                warn(
                    f"line {i + 1} has {length} tokens, more than max_input_length="
                    f"{max_input_length}; its first {max_input_length - 1} are translated"
                )
        sources.append(ids)
    too_long = [i for i, s in enumerate(sources) if len(s) > model_max_length]
    if warn is not None:
        for i in too_long:
            warn(
                f"line {i + 1} has {len(sources[i])} tokens, more than the model's "
                f"max_length={model_max_length}; translated whole, quality may suffer"
            )
    order = np.argsort([len(s) for s in sources], kind="stable")
    results = [None] * len(sources)
    bar = Progress(len(sources), progress)
    chunks = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]

    def finish(chunk, found):
        for i, result in zip(chunk, found, strict=True):
            results[i] = result
        bar.update(len(chunk))

    def run(chunk):
        return search([sources[i] for i in chunk], [int(i) for i in chunk])

    if parallel_batches == 1 or len(chunks) < 2:
        for chunk in chunks:
            finish(chunk, run(chunk))
    else:
        with ThreadPoolExecutor(max_workers=min(parallel_batches, len(chunks))) as pool:
            running = {pool.submit(run, chunk): chunk for chunk in chunks}
            for future in as_completed(running):
                finish(running[future], future.result())
    if warn is not None and too_long:
        warn(
            f"{len(too_long)} of {len(sources)} lines were longer than the model's "
            f"max_length={model_max_length} tokens and were translated whole"
        )
    if warn is not None and truncated:
        warn(
            f"{len(truncated)} of {len(sources)} lines were longer than "
            f"max_input_length={max_input_length} tokens and were truncated"
        )
    return results


def encode_prefixes(tokenizer, texts, max_length=None):
    """Target prefixes as ids (no EOS), one per text (None or "" for none).

    A prefix with a word the vocabulary lacks (it would read as UNK) is
    refused, naming the word: forcing UNK is never what was meant. So is,
    naming its line, a prefix that leaves no room under `max_length` (the
    most tokens generated, EOS included), before any batch is searched.
    """
    prefixes = []
    for n, text in enumerate(texts):
        ids = tokenizer.encode_target(text) if text and text.strip() else []
        if UNK_ID in ids:
            words = [w for w in text.split() if UNK_ID in tokenizer.encode_target(w)]
            raise ValueError(
                f"the target prefix of line {n + 1} ({text!r}) holds "
                f"{words[0] if words else 'a piece'!r}, which is not in the vocabulary."
            )
        if max_length is not None and ids and len(ids) >= max_length:
            raise ValueError(
                f"the target prefix of line {n + 1} ({text!r}) is {len(ids)} tokens: it "
                f"leaves no room under max_length={max_length} (EOS included); raise "
                "max_length or shorten the prefix."
            )
        prefixes.append(ids)
    return prefixes
