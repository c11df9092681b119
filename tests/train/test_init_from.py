"""`train --init-from RUN` with fewer layers than RUN: a student started from its teacher."""

import json
import os

import numpy as np
import pytest

from keras_transformer import cli
from keras_transformer.train.init_from import kept_layers, start_from
from tests.conftest import train_args


def test_kept_layers_are_spread_out_and_one_alone_is_the_decoders_last_the_encoders_first():
    assert kept_layers(3, 3, "decoder") == [0, 1, 2]
    assert kept_layers(3, 1, "decoder") == [2]
    assert kept_layers(3, 1, "encoder") == [0]
    assert kept_layers(3, 2, "decoder") == kept_layers(3, 2, "encoder") == [0, 2]
    assert kept_layers(6, 3, "decoder") == [0, 2, 5]
    assert kept_layers(6, 4, "encoder") == [0, 2, 3, 5]
    for have in range(1, 9):
        for keep in range(2 if have > 1 else 1, have + 1):
            chosen = kept_layers(have, keep, "decoder")
            assert len(set(chosen)) == keep and chosen == sorted(chosen)
            assert chosen[0] == 0 and chosen[-1] == have - 1 and all(0 <= i < have for i in chosen)
    with pytest.raises(ValueError, match="cannot keep 3 of 2 layers"):
        kept_layers(2, 3, "encoder")


def test_a_shallower_model_starts_from_the_runs_kept_layers(trained_run):
    import dataclasses

    from keras_transformer.model import build_transformer, transformer_parts
    from keras_transformer.translation import load_run

    teacher = transformer_parts(load_run(str(trained_run))[0])
    assert teacher.config.num_decoder_layers == 2
    config = dataclasses.replace(teacher.config, num_decoder_layers=1)
    student = build_transformer(config)
    line = start_from(student, str(trained_run))
    assert line == (
        f"Starting from {trained_run}: encoder layers [0, 1] of 2, decoder layers [1] of 2."
    )
    parts = transformer_parts(student)
    pairs = [
        *zip(parts.encoder_layers, teacher.encoder_layers, strict=True),
        (parts.decoder_layers[0], teacher.decoder_layers[1]),
        (parts.source_embedding, teacher.source_embedding),
    ]
    for ours, theirs in pairs:
        for a, b in zip(ours.get_weights(), theirs.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)
    # Every weight of the student came from the teacher: none is left as initialized.
    teacher_arrays = [w.tobytes() for w in load_run(str(trained_run))[0].get_weights()]
    assert all(w.tobytes() in teacher_arrays for w in student.get_weights())


def test_train_starts_a_student_from_its_teacher_and_refuses_a_deeper_one(
    corpus_files, trained_run, tmp_path, capsys
):
    _, paths = corpus_files
    args = train_args(paths, tmp_path / "student", "--max-steps", "2", "--precision", "float32")
    # The teacher's shape and tokenizer: no preset or vocabulary size of our own.
    args = [a for a in args if a not in ("--preset", "tiny", "--vocab-size", "400")]
    assert cli.main([*args, "--init-from", str(trained_run), "--num-decoder-layers", "1"]) == 0
    with open(tmp_path / "student" / "config.json") as f:
        config = json.load(f)
    assert (config["num_encoder_layers"], config["num_decoder_layers"]) == (2, 1)
    assert "encoder layers [0, 1] of 2, decoder layers [1] of 2." in capsys.readouterr().out
    deeper = [*args, "--init-from", str(trained_run), "--num-encoder-layers", "3"]
    deeper[deeper.index("--out") + 1] = str(tmp_path / "deeper")
    with pytest.raises(SystemExit, match="has 2 encoder layers; a model started from it has"):
        cli.main(deeper)
    assert not os.path.exists(tmp_path / "deeper")  # refused before anything is written
    with pytest.raises(SystemExit, match="leave out hidden_dim"):
        cli.main([*args, "--init-from", str(trained_run), "--hidden-dim", "32"])
