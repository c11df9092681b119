#!/usr/bin/env bash
# Trains and evaluates the `small` preset on Multi30k in one direction, the
# recipe of the README's quality tables, each chosen on val
# (benchmarks/results/multi30k/):
#   de->en (and any pair but en->de): train's defaults for 10 epochs (on
#     Multi30k, 1024-token batches, a 3-epoch warm-up, dropout 0.1, epochs
#     ranked by greedy val BLEU);
#   en->de: 20 epochs, R-Drop with alpha 5 and a 2048-wide feed-forward layer
#     (RDROP=0 INTERMEDIATE_DIM=1024 gives train's defaults).
#   usage: examples/multi30k.sh SRC TGT [RUN_DIR]     e.g. examples/multi30k.sh de en
# Every epoch is scored by greedy BLEU on val; the final weights are the best
# on val among the last, the best and the means of up to 10 epoch checkpoints.
# Rerunning the same command resumes an interrupted run.
# Overridable: MULTI30K (data folder; unset: data/multi30k; missing files are
# fetched there by `keras-transformer data multi30k`), MULTI30K_MIRROR (that
# command's --mirror URL), EPOCHS, TOKENS (--tokens-per-batch; unset:
# train's automatic choice), DROPOUT (--dropout; unset: the preset's),
# ATTENTION_DROPOUT (--attention-dropout; unset: DROPOUT's value), VOCAB
# (--vocab-size; unset: 8000), COOLDOWN (--cooldown; unset: none), SUBWORD_ALPHA
# (--subword-alpha; unset: no subword sampling), LR_SCALE
# (--learning-rate-scale; unset: the paper's peak for the width), PRECISION
# (--precision; unset: auto), AVERAGE (--average: the most epoch checkpoints
# averaged; unset: 10), SEED (--seed; unset: 0), RDROP (--rdrop-alpha; 0: off),
# LABEL_SMOOTHING (--label-smoothing; unset: 0.1), INTERMEDIATE_DIM
# (--intermediate-dim: the feed-forward width; the preset's is 1024), KT (the
# keras-transformer command).
set -euo pipefail
SRC=${1:?source language (de, en or fr)}
TGT=${2:?target language}
RUN=${3:-runs/multi30k-$SRC-$TGT}
DATA=${MULTI30K:-data/multi30k}
KT=${KT:-.venv/bin/keras-transformer}
ls "$DATA"/{train,val,test_2016_flickr}.{"$SRC","$TGT"}.gz >/dev/null 2>&1 ||
  "$KT" data multi30k --out "$DATA" --languages "$SRC" "$TGT" ${MULTI30K_MIRROR:+--mirror "$MULTI30K_MIRROR"}
if [ "$SRC-$TGT" = en-de ]; then
  : "${EPOCHS:=20}" "${RDROP:=5}" "${INTERMEDIATE_DIM:=2048}"
fi

"$KT" train \
  --src-train "$DATA/train.$SRC.gz" --tgt-train "$DATA/train.$TGT.gz" \
  --src-valid "$DATA/val.$SRC.gz" --tgt-valid "$DATA/val.$TGT.gz" \
  --out "$RUN" --preset small --epochs "${EPOCHS:-10}" \
  ${TOKENS:+--tokens-per-batch "$TOKENS"} ${DROPOUT:+--dropout "$DROPOUT"} \
  ${ATTENTION_DROPOUT:+--attention-dropout "$ATTENTION_DROPOUT"} \
  ${VOCAB:+--vocab-size "$VOCAB"} ${COOLDOWN:+--cooldown "$COOLDOWN"} \
  ${SUBWORD_ALPHA:+--subword-alpha "$SUBWORD_ALPHA"} \
  ${LR_SCALE:+--learning-rate-scale "$LR_SCALE"} \
  ${PRECISION:+--precision "$PRECISION"} ${AVERAGE:+--average "$AVERAGE"} \
  ${SEED:+--seed "$SEED"} ${RDROP:+--rdrop-alpha "$RDROP"} \
  ${LABEL_SMOOTHING:+--label-smoothing "$LABEL_SMOOTHING"} \
  ${INTERMEDIATE_DIM:+--intermediate-dim "$INTERMEDIATE_DIM"}

for BEAM in 1 5; do
  "$KT" evaluate "$RUN" --beam "$BEAM" \
    --src "$DATA/test_2016_flickr.$SRC.gz" --ref "$DATA/test_2016_flickr.$TGT.gz" \
    --output "$RUN/test_2016_flickr.beam$BEAM.hyp"
done
