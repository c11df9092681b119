"""Corpus scores with sacreBLEU: BLEU (with its signature), chrF, lower-cased tokenized BLEU."""

from __future__ import annotations

import sacrebleu


def score_translations(hypotheses, references) -> dict:
    """Scores detokenized hypotheses against one reference each.

    Returns a dict with `bleu` (cased, 13a, sacreBLEU's default) and its
    `bleu_signature`, `chrf`, and `bleu_lowercase` (13a tokenization,
    lower-cased) for comparison with published word-level results.
    """
    if len(hypotheses) != len(references):
        raise ValueError(
            f"{len(hypotheses)} hypotheses but {len(references)} references: "
            "they must be parallel, one per line."
        )
    bleu = sacrebleu.metrics.BLEU()
    bleu_score = bleu.corpus_score(hypotheses, [references])
    lower = sacrebleu.metrics.BLEU(lowercase=True, tokenize="13a")
    lower_score = lower.corpus_score(hypotheses, [references])
    chrf = sacrebleu.metrics.CHRF()
    chrf_score = chrf.corpus_score(hypotheses, [references])
    return {
        "bleu": round(bleu_score.score, 2),
        "bleu_signature": str(bleu.get_signature()),
        "bleu_lowercase": round(lower_score.score, 2),
        "bleu_lowercase_signature": str(lower.get_signature()),
        "chrf": round(chrf_score.score, 2),
        "chrf_signature": str(chrf.get_signature()),
        "sentences": len(references),
    }
