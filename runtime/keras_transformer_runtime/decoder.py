"""The decoder interface: what a model must offer for `translator.Translator` to search it.

Two implementations: `onnx_decoder.OnnxDecoder` (ONNX Runtime, this
package) and `keras_transformer.keras_decoder.KerasDecoder` (the Keras
layers). Everything above it, search, n-best lists, prefixes,
constraints, forced scoring, alignment and text batching, is written once,
in `translator.Translator`, for both.

Conventions: token ids of `specials` (padding 0, BOS 1, EOS 2); `source` is
an int32 `(sentences, source_len)` array padded with 0 (`sources.source_array`
with `source_multiple`); `limits` are per-sentence maximum output lengths
(EOS included; 0 for an empty source); `target_inputs` are BOS + target rows
padded with 0 (`sources.teacher_inputs`), and the `labels` they predict
(`sources.teacher_labels`).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from keras_transformer_runtime.options import NO_MASKS, Masks


class DecoderState(Protocol):
    """The running state of one batch search: `rows` hypotheses per sentence.

    Row `p * rows + j` is hypothesis j of sentence p.

    Attributes:
        drops_finished: whether `reorder` takes fewer rows than the state
            holds (the rows of sentences still searched), so that the step
            shrinks as sentences finish (`search.search_loop`).
        selects: whether `step` takes `top_k` (optional; False if absent).
    """

    drops_finished: bool

    def step(self, last: np.ndarray, t: int, top_k: int = 0):
        """Runs the decoder on `last`, the int32 newest token of every row (BOS at `t`
        0), and returns the next-token log-probabilities, `(rows, vocabulary)`.

        With `top_k` (where `selects`), returns `(log_probs, (values, ids))`:
        also each row's `top_k` best tokens other than padding and BOS, best
        first (ties: the lower id), and their log-probabilities, as the search
        graphs select them; `search.search_loop` then skips its own selection
        on the steps that no option rescores."""

    def reorder(self, rows: np.ndarray) -> None:
        """Row i of the state becomes row `rows[i]` of the previous state (its cache)."""


class Decoder(Protocol):
    """A model seen as an encoder, a cached decoder step and a teacher-forced pass.

    Attributes:
        max_length: the positions the model trained on (longer sources are
            taken whole; the searches' default output limits derive from it).
        vocabulary_size: the target vocabulary's size.
        source_multiple: the source width is padded to a multiple of this
            (8 for a compiled decoder, so that few shapes are compiled; 1
            where any shape costs nothing).
    """

    max_length: int
    vocabulary_size: int
    source_multiple: int

    def start(self, source: np.ndarray, rows: int, steps: int) -> DecoderState:
        """Encodes `source` and returns a state of `rows` hypotheses per sentence, for
        a search of at most `steps` steps."""

    def greedy(
        self,
        source: np.ndarray,
        limits: np.ndarray,
        masks: Masks = NO_MASKS,
        attention: bool = False,
    ) -> tuple | None:
        """Greedy search on a graph-resident fast path under the stateless `masks`:
        `(tokens, token_scores)`, per sentence its tokens as `spec.greedy` gives
        them (as `spec.SentenceSearch` with masks) and its step log-probabilities
        (EOS included when produced); or None where the decoder has no such path
        (the translator then runs `search.search_loop`). With `attention`, a third
        list: per sentence the alignment weights of its steps, `(steps,
        source_len)` (as `alignment_weights` gives them for its output, EOS's row
        included when produced), or None where the path cannot return them."""

    def beam(
        self,
        source: np.ndarray,
        limits: np.ndarray,
        beam_size: int,
        length_penalty: float,
        n_best: int = 1,
        masks: Masks = NO_MASKS,
        length_penalty_form: str = "gnmt",
        attention: bool = False,
    ) -> tuple | None:
        """Beam search on a fast path under the stateless `masks` and the length
        penalty's form (`options.SearchOptions.length_penalty_form`): `(tokens, scores,
        token_scores)`, per sentence a list of its `n_best` best hypotheses' (best
        first; the first as `spec.beam` gives it, all as `spec.SentenceSearch`
        with `n_best` and the masks): tokens, score and step log-probabilities
        (EOS included when it ended with one); or None. With `attention`, a
        fourth: each hypothesis's alignment weights, as `greedy`'s."""

    def label_log_probs(
        self, source: np.ndarray, target_inputs: np.ndarray, labels: np.ndarray
    ) -> np.ndarray:
        """Teacher-forced log-probabilities of `labels` (`sources.teacher_labels`) at
        each position of `target_inputs`: float64 `(batch, width)`."""

    def alignment_weights(self, source: np.ndarray, target_inputs: np.ndarray) -> np.ndarray:
        """The cross-attention of `spec.alignment_layer`, averaged over heads,
        teacher-forced: `(batch, width, source_len)`; row i predicts token i."""

    def parallel(self, count: int, beam_size: int) -> list:
        """`count` decoders for as many searches at once (this one may repeat)."""
