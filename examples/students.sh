#!/usr/bin/env bash
# Distilled students of the de->en `small` teacher on Multi30k, and the table that
# compares them (benchmarks/README.md, "Students"):
#   1. the teacher: examples/multi30k.sh de en (10 epochs), unless RUNS/teacher exists;
#   2. its beam-4 translations of the training sources (`distill`, whole vocabulary);
#   3. students, each trained for EPOCHS epochs with a WARMUP-update warm-up, on the
#      distilled targets and (the controls) on the original ones: 6-1 and 6-2 at
#      d256 (presets student-6-1 and student-6-2); 3-1, 2-1 and 1-1 students started
#      from the teacher's own layers (train --init-from, "-sft"), with a 500-update
#      warm-up, on the distilled targets, and the 1-1 on the original ones too
#      (6-1-d192, a 6-1 at d192 with FFN 768, is one more name to give STUDENTS);
#   4. every model exported in int8 with a shortlist counted from the original
#      training pairs (the 1-1-sft-original also with 3 pieces per source piece),
#      then `benchmarks.students`: the goal cell side by side (int8 greedy, batch
#      32, one thread), val, and each model's grid on test_2016_flickr.
#   usage: examples/students.sh [RUNS]      (default runs/students)
# Rerunning resumes: finished steps are skipped, a killed training resumes.
# Overridable: MULTI30K (data folder, default data/multi30k), EPOCHS (10: the teacher's), WARMUP
# (1014: two epochs of updates), STUDENTS (which to train, default the eight below,
# as NAME:DATA pairs), KT (the keras-transformer command), PYTHON.
set -euo pipefail
RUNS=${1:-runs/students}
DATA=${MULTI30K:-data/multi30k}
KT=${KT:-.venv/bin/keras-transformer}
PYTHON=${PYTHON:-.venv/bin/python}
EPOCHS=${EPOCHS:-10}
WARMUP=${WARMUP:-1014}
STUDENTS=${STUDENTS:-"6-1:distilled 6-2:distilled 6-1:original 6-2:original 3-1-sft:distilled 2-1-sft:distilled 1-1-sft:distilled 1-1-sft:original"}
mkdir -p "$RUNS"

[ -f "$RUNS/teacher/model.keras" ] || MULTI30K=$DATA KT=$KT examples/multi30k.sh de en "$RUNS/teacher"
"$KT" distill "$RUNS/teacher" --src "$DATA/train.de.gz" --out "$RUNS/distilled" --beam 4

shape() {  # the train flags of a student's name
  case $1 in
    6-1) echo --preset student-6-1 ;;
    6-2) echo --preset student-6-2 ;;
    6-1-d192) echo --preset student-6-1 --hidden-dim 192 --intermediate-dim 768 ;;
    # Started from the teacher's embeddings and layers (its last decoder layer).
    3-1-sft) echo --init-from "$RUNS/teacher" --num-decoder-layers 1 --warmup-steps 500 ;;
    2-1-sft) echo --init-from "$RUNS/teacher" --num-layers 2 --num-decoder-layers 1 --warmup-steps 500 ;;
    1-1-sft) echo --init-from "$RUNS/teacher" --num-layers 1 --warmup-steps 500 ;;
    *) echo "unknown student $1" >&2; exit 2 ;;
  esac
}
MODELS=(teacher="$RUNS/teacher")
for STUDENT in $STUDENTS; do
  NAME=${STUDENT%%:*}
  SOURCE=${STUDENT##*:}
  RUN="$RUNS/$NAME-$SOURCE"
  if [ "$SOURCE" = distilled ]; then
    TRAIN=(--src-train "$RUNS/distilled/train.src" --tgt-train "$RUNS/distilled/train.tgt")
  else
    TRAIN=(--src-train "$DATA/train.de.gz" --tgt-train "$DATA/train.en.gz")
  fi
  FLAGS=$(shape "$NAME")
  # shellcheck disable=SC2086
  "$KT" train "${TRAIN[@]}" --src-valid "$DATA/val.de.gz" --tgt-valid "$DATA/val.en.gz" \
    --out "$RUN" --epochs "$EPOCHS" --warmup-steps "$WARMUP" $FLAGS
  MODELS+=("$NAME-$SOURCE=$RUN")
done

for MODEL in "${MODELS[@]}"; do
  RUN=${MODEL#*=}
  [ -f "$RUN/onnx-shortlist/manifest.json" ] ||
    "$KT" export "$RUN" --out "$RUN/onnx-shortlist" --precision int8 \
      --shortlist-data "$DATA/train.de.gz" "$DATA/train.en.gz"
done
# The same 1-1 with a shorter list (3 pieces per source piece: the shortest of 3, 5,
# 7 and 10 within 1.0 val BLEU of the teacher), given to the benchmark as its export folder.
LIST3="$RUNS/1-1-sft-original/onnx-list3"
if [ -f "$RUNS/1-1-sft-original/model.keras" ]; then
  [ -f "$LIST3/manifest.json" ] ||
    "$KT" export "$RUNS/1-1-sft-original" --out "$LIST3" --precision int8 \
      --shortlist-data "$DATA/train.de.gz" "$DATA/train.en.gz" --shortlist-per-piece 3
  MODELS+=("1-1-sft-original-list3=$LIST3")
fi

# The goal cell, every model in one process (int8 greedy, batch 32, one thread).
"$PYTHON" -m benchmarks.students "${MODELS[@]}" --data "$DATA" \
  --splits test_2016_flickr val --precisions int8 --beams 1 --batches 32 --threads 1 \
  --repeats 3 --out "$RUNS/students-goal.json"
"$PYTHON" -m benchmarks.students "${MODELS[@]}" --data "$DATA" --splits val --precisions int8 \
  --threads 2 --batches 32 --repeats 1 --out "$RUNS/students-val.json"
TESTS=()
for MODEL in "${MODELS[@]}"; do  # one process per model
  "$PYTHON" -m benchmarks.students "$MODEL" --data "$DATA" --ctranslate2 --batch1-lines 200 \
    --out "$RUNS/students-test-${MODEL%%=*}.json"
  TESTS+=("$RUNS/students-test-${MODEL%%=*}.json")
done
"$PYTHON" -m benchmarks.students --table "${TESTS[@]}" "$RUNS/students-val.json" \
  --plot "$RUNS/students.png"
