"""The settings of a run: their checks, automatic values, and the parser generated from them."""

import dataclasses
import math
import typing

import keras
import numpy as np
import pytest

from keras_transformer.data.pipeline import EncodedPairs, PipelineStats
from keras_transformer.train.batch_size import (
    AUTO_TOKENS_PER_BATCH,
    MIN_UPDATES_PER_EPOCH,
    automatic_batch_rule,
    automatic_tokens_per_batch,
)
from keras_transformer.train.settings import (
    DEFAULT_EPOCHS,
    GROUPS,
    KEEP_CHECKPOINTS,
    PAPER_WARMUP_STEPS,
    WARMUP_EPOCHS,
    TrainSettings,
)


def _train_parser():
    from keras_transformer.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices["train"]


def _help(parser, action) -> str:
    """An option's help as `--help` prints it (`%(default)s` filled in), on one line."""
    return " ".join(parser._get_formatter()._expand_help(action).split())


def test_every_setting_is_an_option_with_its_default_choices_and_type():
    """The parser is generated from `TrainSettings`: no field without its option, and
    no option whose default, choices or type differ from the field's."""
    parser = _train_parser()
    actions = {a.dest: a for a in parser._actions}
    hints = typing.get_type_hints(TrainSettings)
    titles = {g.title: g for g in parser._action_groups}
    for field in dataclasses.fields(TrainSettings):
        assert field.name in actions, f"no option for the setting {field.name}"
        action = actions[field.name]
        assert action.option_strings == ["--" + field.name.replace("_", "-")]
        assert field.metadata["help"], f"{field.name} has no help"
        if field.default is dataclasses.MISSING:
            assert action.required, field.name
        else:
            assert action.default == field.default and not action.required, field.name
        assert action.choices == field.metadata.get("choices"), field.name
        assert action.metavar == field.metadata.get("metavar"), field.name
        held = [t for t in typing.get_args(hints[field.name]) or (hints[field.name],)]
        held = next(t for t in held if t is not type(None))
        if held is bool:
            assert action.nargs == 0 and action.const is True, field.name  # store_true
        else:
            assert action.type is (None if held is str else held), field.name
        # In the help, under its group's title.
        group = titles[GROUPS[field.metadata["group"]]]
        assert action in group._group_actions, field.name
    # The options that are not settings: --help, the run directory and one shortcut.
    fields = {f.name for f in dataclasses.fields(TrainSettings)}
    assert set(actions) - fields == {"help", "out", "average_last"}


def test_the_choices_are_the_ones_the_settings_accept(tmp_path):
    paths = []
    for name in ("a", "b"):
        (tmp_path / name).write_text("x\n")
        paths.append(str(tmp_path / name))
    for field in dataclasses.fields(TrainSettings):
        for choice in field.metadata.get("choices", ()):
            TrainSettings(*paths, *paths, preset="tiny", **{field.name: choice})
        if "choices" in field.metadata:
            with pytest.raises(ValueError, match=f"{field.name} must be one of"):
                TrainSettings(*paths, *paths, **{field.name: "nonsense"})
    keras.backend.clear_session()


def test_the_train_commands_help_states_the_defaults_train_applies():
    """The help is written from the constants and the code that applies them."""
    parser = _train_parser()
    helps = {a.dest: _help(parser, a) for a in parser._actions if a.help}
    assert f"default {KEEP_CHECKPOINTS}," in helps["average"]
    assert f"(default: {automatic_batch_rule()})" in helps["tokens_per_batch"]
    assert f"at least {MIN_UPDATES_PER_EPOCH} updates an epoch" in helps["tokens_per_batch"]
    assert f"default {DEFAULT_EPOCHS} when nothing else is set" in helps["epochs"]
    assert (
        f"{WARMUP_EPOCHS} epochs of updates, at most the paper's {PAPER_WARMUP_STEPS}"
        in (helps["warmup_steps"])
    )
    assert "(default 8000)" in helps["vocab_size"] and "(default: small)" in helps["preset"]


def test_average_last_is_final_last_with_that_average(tmp_path):
    from keras_transformer.cli import _settings_from_arguments

    paths = []
    for name in ("a", "b"):
        (tmp_path / name).write_text("x\n")
        paths.append(str(tmp_path / name))
    files = ["--src-train", paths[0], "--tgt-train", paths[1]]
    files += ["--src-valid", paths[0], "--tgt-valid", paths[1], "--out", str(tmp_path / "run")]
    parser = _train_parser()
    plain = _settings_from_arguments(parser.parse_args(files), TrainSettings)
    assert (plain.final, plain.average) == ("auto", KEEP_CHECKPOINTS)
    last = parser.parse_args([*files, "--final", "best", "--average-last", "5"])
    assert (_settings_from_arguments(last, TrainSettings).final, last.average_last) == ("last", 5)
    assert _settings_from_arguments(last, TrainSettings).average == 5
    keras.backend.clear_session()


def test_automatic_warmup_is_three_epochs_and_keeps_the_papers_peak(tmp_path):
    paths = []
    for name in ("a", "b"):
        (tmp_path / name).write_text("x\n")
        paths.append(str(tmp_path / name))
    settings = TrainSettings(*paths, *paths, preset="tiny")
    assert settings.precision == "auto"
    assert settings.schedule(250) == (750, pytest.approx(math.sqrt(750 / 4000)))
    assert settings.schedule(2_000) == (4000, 1.0)  # a big corpus: the paper's schedule
    explicit = TrainSettings(*paths, *paths, warmup_steps=800, learning_rate_scale=0.4)
    assert explicit.schedule(250) == (800, 0.4)
    assert settings.select_by == "bleu"  # the measure a translation is judged by
    assert TrainSettings(*paths, *paths, strategy="data-parallel").select_by == "bleu"
    with pytest.raises(ValueError, match="select_by must be one of loss, bleu"):
        TrainSettings(*paths, *paths, select_by="accuracy")
    with pytest.raises(ValueError, match="patience must be a positive integer"):
        TrainSettings(*paths, *paths, patience=0)
    keras.backend.clear_session()


def test_cooldown_covers_the_last_fraction_of_the_shorter_budget(tmp_path):
    paths = []
    for name in ("a", "b"):
        (tmp_path / name).write_text("x\n")
        paths.append(str(tmp_path / name))
    assert TrainSettings(*paths, *paths, epochs=20).run_length(500) == (None, None)
    assert TrainSettings(*paths, *paths, epochs=20, cooldown=0.3).run_length(500) == (10_000, 3000)
    steps = TrainSettings(*paths, *paths, epochs=20, max_steps=4000, cooldown=0.25)
    assert steps.run_length(500) == (4000, 1000)
    assert TrainSettings(*paths, *paths, max_steps=7, cooldown=1.0).run_length(500) == (7, 7)
    with pytest.raises(ValueError, match="cooldown must be a fraction in"):
        TrainSettings(*paths, *paths, epochs=5, cooldown=1.5)
    with pytest.raises(ValueError, match="cooldown needs the run's length in updates"):
        TrainSettings(*paths, *paths, max_minutes=10, cooldown=0.2)


def _pairs(count, length=15):
    """`count` pairs of `length` pieces per side (16 positions with EOS)."""
    ids = [np.full(length, 5, np.int32)] * count
    return EncodedPairs(ids, ids, 128, PipelineStats(count, 0, 0, count, 0, 0))


def test_the_automatic_batch_is_the_largest_with_enough_updates_else_the_smallest():
    assert AUTO_TOKENS_PER_BATCH == (4096, 2048, 1024) and MIN_UPDATES_PER_EPOCH == 400
    # 16-position pairs: 256 a batch at 4096 tokens, 128 at 2048, 64 at 1024.
    for count, accumulate, chosen in [
        (256 * 400, 1, 4096),  # exactly 400 updates at 4096
        (256 * 399, 1, 2048),  # 399 at 4096, 798 at 2048
        (128 * 400, 2, 1024),  # accumulation halves the updates: 200 at 2048, 400 at 1024
        (64 * 100, 1, 1024),  # too few at every size: the smallest
        (1, 1, 1024),
    ]:
        pairs = _pairs(count)
        assert pairs.batches(4096) == -(-count // 256)
        assert automatic_tokens_per_batch(pairs, accumulate) == chosen, (count, accumulate)


def test_init_from_takes_the_shape_and_tokenizer_of_its_run(tmp_path):
    paths = []
    for name in ("a", "b"):
        (tmp_path / name).write_text("x\n")
        paths.append(str(tmp_path / name))
    with pytest.raises(ValueError, match="init_from: no model.keras in"):
        TrainSettings(*paths, *paths, init_from=str(tmp_path))
    (tmp_path / "model.keras").write_bytes(b"")
    settings = TrainSettings(*paths, *paths, init_from=str(tmp_path), learning_rate=5e-5)
    assert settings.init_from == str(tmp_path)
    with pytest.raises(ValueError, match="leave out hidden_dim, num_heads"):
        TrainSettings(
            *paths, *paths, init_from=str(tmp_path), num_layers=2, hidden_dim=64, num_heads=2
        )
    with pytest.raises(ValueError, match="learning_rate must be positive"):
        TrainSettings(*paths, *paths, learning_rate=0.0)
    keras.backend.clear_session()
