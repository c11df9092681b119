#!/usr/bin/env bash
# Trains and evaluates the `small` preset on Multi30k in one direction, with a
# 30-minute training budget, as reported in the README.
#   usage: examples/multi30k.sh SRC TGT [RUN_DIR]     e.g. examples/multi30k.sh de en
# Rerunning the same command resumes an interrupted run; rerunning a finished
# run with another AVERAGE_LAST only re-averages and re-scores it.
# Overridable: MULTI30K (data folder), WARMUP, LR_SCALE, AVERAGE_LAST.
set -euo pipefail
SRC=${1:?source language (de, en or fr)}
TGT=${2:?target language}
RUN=${3:-runs/multi30k-$SRC-$TGT}
DATA=${MULTI30K:-../shared/data/multi30k}
KT=${KT:-.venv/bin/keras-transformer}

"$KT" train \
  --src-train "$DATA/train.$SRC.gz" --tgt-train "$DATA/train.$TGT.gz" \
  --src-valid "$DATA/val.$SRC.gz" --tgt-valid "$DATA/val.$TGT.gz" \
  --out "$RUN" --preset small \
  --max-minutes 30 --tokens-per-batch 2048 \
  --warmup-steps "${WARMUP:-800}" --learning-rate-scale "${LR_SCALE:-0.4}" \
  --dropout 0.1 --label-smoothing 0.1 --vocab-size 8000 --average-last "${AVERAGE_LAST:-5}" \
  --seed 0

for BEAM in 1 5; do
  "$KT" evaluate "$RUN" --beam "$BEAM" \
    --src "$DATA/test_2016_flickr.$SRC.gz" --ref "$DATA/test_2016_flickr.$TGT.gz" \
    --output "$RUN/test_2016_flickr.beam$BEAM.hyp"
done
