"""The decoding options: `SearchOptions`, checked when made, and their fields as the
front ends offer them (`option_fields`).

Each option is defined once, here, with its help and its flag: both
translate commands' flags and the server's request fields and schema are
made from these fields. What each option does to a search is
`spec.step_scores`'s and `spec.SentenceSearch`'s. Needs numpy only.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from keras_transformer_runtime.specials import UNK_ID

# The length normalisations of beam search: GNMT's (Wu et al. 2016), ours by
# default, and the average of transformers and fairseq (`spec.length_penalty_factor`).
LENGTH_PENALTY_FORMS = ("gnmt", "average")


def _is_int(value):
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def _is_number(value):
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))


def _option(default, help, flag=None, output=False, front_end=True):
    """A `SearchOptions` field with what its front ends need: its help, its
    command-line flag (default `--name-with-dashes`), whether it shapes the
    output (the commands that write no hypotheses leave it out), and whether
    the front ends offer it as it is (`option_fields`)."""
    metadata = {"help": help, "flag": flag, "output": output, "front_end": front_end}
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class Masks:
    """The stateless masks of a search: ids never generated (beyond padding and BOS,
    which no search generates) and EOS before `min_length` tokens. They depend on
    no hypothesis's tokens but their count, so the search graphs take them as
    inputs (`SearchOptions.graph_masks`)."""

    suppressed: tuple = ()
    min_length: int = 0


NO_MASKS = Masks()


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """Every decoding option, checked when made; one meaning in every decoder.

    The defaults are the plain search above (`is_plain`), which the fast
    paths (the ONNX search graphs, the Keras compiled greedy loop) run; the
    ONNX graphs also take n-best lists, token scores and the stateless masks
    (`graph_masks`); any other value goes through `SentenceSearch`'s rules
    (`step_scores`) in the step-by-step loop. What
    each option does, beside CTranslate2's `translate_batch`, is in
    docs/decoding.md.

    Per-sentence inputs (target prefixes) are not options: the searches
    take them beside the options, one per sentence. Each field is defined
    once, with its help: both translate commands' flags and the server's
    request fields and schema are made from them (`option_fields`).
    """

    beam_size: int = _option(
        4, "live hypotheses kept; 1 is greedy search (or sampling)", flag="--beam"
    )
    length_penalty: float = _option(
        0.6,
        "beam search's alpha: scores are divided by ((5 + length) / 6) ** alpha (Wu et al. "
        "2016); higher favours longer translations; 0 disables it",
    )
    length_penalty_form: str = _option(
        "gnmt",
        "how --length-penalty divides a score: gnmt, ((5 + length) / 6) ** alpha; or "
        "average, length ** alpha (transformers' and fairseq's form; the beam search then "
        "stops only when no live hypothesis can win at the longest length)",
    )
    n_best: int = _option(
        1, "hypotheses answered per sentence, best first (at most beam_size)", output=True
    )
    token_scores: bool = _option(False, "also each token's log-probability", output=True)
    # Id sequences never generated (a 1-tuple: one token); the front ends take
    # them as text (`--suppress`, "suppress") and tokenize it.
    suppress_sequences: tuple = _option((), "", front_end=False)
    disable_unk: bool = _option(False, "never generate the unknown token")
    min_length: int = _option(0, "EOS is not allowed before this many tokens")
    max_length: int | None = _option(
        None, "most output tokens per sentence, EOS included; default: the source length + 50"
    )
    repetition_penalty: float = _option(
        1.0, "> 1 makes tokens already generated less likely (1: off)"
    )
    no_repeat_ngram_size: int = _option(0, "no n-gram of this size twice in an output (0: off)")
    sampling_topk: int = _option(
        1, "1: search; 0: sample from every token; k > 1: from the k best (needs beam 1)"
    )
    sampling_topp: float = _option(1.0, "sample from the smallest set of this probability mass")
    sampling_temperature: float = _option(1.0, "sampling divides the log-probabilities by this")
    seed: int = _option(
        0,
        "sampling: sentence i of the input draws from a generator seeded (seed, i), so "
        "whatever the batch",
    )
    max_input_length: int | None = _option(
        None,
        "sources longer than this many tokens are truncated (with a warning); default: "
        "translated whole",
    )
    alignment: bool = _option(
        False,
        "also, per output token, the source position it attends to most (0-based, of the "
        "tokenized sentences)",
        output=True,
    )

    def __post_init__(self):
        def refuse(name, what):
            raise ValueError(f"{name} must be {what}. Received: {name}={getattr(self, name)!r}")

        for name in ("beam_size", "n_best"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                refuse(name, "a positive integer")
        for name in ("min_length", "no_repeat_ngram_size", "sampling_topk", "seed"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                refuse(name, "a non-negative integer")
        for name in ("max_length", "max_input_length"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                refuse(name, "a positive integer or None")
        if not _is_number(self.length_penalty) or not self.length_penalty >= 0:
            refuse("length_penalty", "a non-negative number")
        if self.length_penalty_form not in LENGTH_PENALTY_FORMS:
            refuse("length_penalty_form", " or ".join(repr(f) for f in LENGTH_PENALTY_FORMS))
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            refuse("repetition_penalty", "a positive number")
        if not _is_number(self.sampling_temperature) or not self.sampling_temperature > 0:
            refuse("sampling_temperature", "a positive number")
        if not _is_number(self.sampling_topp) or not 0 < self.sampling_topp <= 1:
            refuse("sampling_topp", "in (0, 1]")
        if self.n_best > self.beam_size:
            raise ValueError(
                f"n_best must be at most beam_size: a search keeps beam_size hypotheses. "
                f"Received: n_best={self.n_best}, beam_size={self.beam_size}"
            )
        if self.max_length is not None and self.min_length >= self.max_length:
            raise ValueError(
                "min_length must be less than max_length (which counts EOS). "
                f"Received: min_length={self.min_length}, max_length={self.max_length}"
            )
        if self.sampling and self.beam_size != 1:
            raise ValueError(
                "sampling (sampling_topk != 1) draws one hypothesis per sentence: it needs "
                f"beam_size=1. Received: beam_size={self.beam_size}"
            )
        if not self.sampling and (self.sampling_topp != 1 or self.sampling_temperature != 1):
            raise ValueError(
                "sampling_topp and sampling_temperature apply only when sampling: set "
                "sampling_topk to 0 (every token) or to k > 1 (the k best)."
            )
        sequences = []
        for sequence in self.suppress_sequences:
            ids = tuple(sequence) if not _is_int(sequence) else (sequence,)
            if not ids or not all(_is_int(i) and i >= 0 for i in ids):
                raise ValueError(
                    "suppress_sequences must hold non-empty sequences of token ids. "
                    f"Received: {sequence!r}"
                )
            sequences.append(tuple(int(i) for i in ids))
        object.__setattr__(self, "suppress_sequences", tuple(sequences))

    @property
    def sampling(self):
        """Whether the search draws tokens at random (CTranslate2's rule: top-k other than 1)."""
        return self.sampling_topk != 1

    def is_plain(self):
        """Whether only the plain search's options are set (beam, length penalty, lengths;
        the alignment is read after the search).

        Such a search runs on the fast paths, so an option not used costs nothing.
        """
        plain = dataclasses.replace(
            SearchOptions(),
            beam_size=self.beam_size,
            length_penalty=self.length_penalty,
            max_length=self.max_length,
            max_input_length=self.max_input_length,
            alignment=self.alignment,
        )
        return self == plain

    def graph_masks(self):
        """The `Masks` under which the search graphs run this search, or None when it
        needs the step-by-step loop.

        Beside the plain options, the graphs take n-best lists, token scores and
        the stateless masks: `disable_unk`, `min_length` and one-token
        `suppress_sequences`, and either length penalty form (a decoder whose
        graphs lack the average form runs the loop). Sampling, the repetition
        penalty, no-repeat n-grams and longer suppressed sequences depend on
        each hypothesis's tokens: the loop runs those.
        """
        return _graph_masks(self)

    def check_ids(self, vocabulary_size, prefixes=()):
        """Refuses suppressed ids and prefix ids outside the vocabulary, naming them."""
        for sequence in self.suppress_sequences:
            for i in sequence:
                if i >= vocabulary_size:
                    raise ValueError(
                        f"suppress_sequences holds token id {i}, outside the vocabulary "
                        f"of {vocabulary_size} ids."
                    )
        for n, prefix in enumerate(prefixes or ()):
            for i in prefix or ():
                if not _is_int(i) or not UNK_ID <= i < vocabulary_size:
                    raise ValueError(
                        f"the target prefix of sentence {n} holds token id {i!r}: a prefix "
                        f"holds tokens of the output, ids {UNK_ID}..{vocabulary_size - 1}."
                    )


@dataclasses.dataclass(frozen=True)
class OptionField:
    """A `SearchOptions` field as the front ends offer it (`option_fields`)."""

    name: str
    kind: type  # int, float or bool
    default: object
    help: str
    flag: str  # the command-line flag
    output: bool  # it shapes the output (n-best, scores, alignments)
    optional: bool  # None is a value (the default)


@functools.cache
def option_fields():
    """The options the front ends offer as they are, in `SearchOptions` order (a tuple)."""
    found = []
    for field in dataclasses.fields(SearchOptions):
        meta = field.metadata
        if not meta.get("front_end", True):
            continue
        default = field.default
        kind = type(default) if default is not None else int
        flag = meta["flag"] or "--" + field.name.replace("_", "-")
        found.append(
            OptionField(
                field.name, kind, default, meta["help"], flag, meta["output"], default is None
            )
        )
    return tuple(found)


@functools.lru_cache(maxsize=256)
def _graph_masks(options):
    """`SearchOptions.graph_masks`, once per distinct options (they are frozen and
    hashable): a search at batch 1 asks at every sentence."""
    single = [s[0] for s in options.suppress_sequences if len(s) == 1]
    rest = dataclasses.replace(
        options,
        n_best=1,
        token_scores=False,
        disable_unk=False,
        min_length=0,
        suppress_sequences=tuple(s for s in options.suppress_sequences if len(s) > 1),
        length_penalty_form="gnmt",
    )
    if not rest.is_plain():
        return None
    suppressed = set(single) | ({UNK_ID} if options.disable_unk else set())
    return Masks(tuple(sorted(int(i) for i in suppressed)), int(options.min_length))
