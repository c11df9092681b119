import pytest

from keras_transformer import TransformerConfig


def test_presets():
    base = TransformerConfig.from_preset("paper-base")
    assert (base.num_layers, base.hidden_dim, base.intermediate_dim, base.num_heads) == (
        6,
        512,
        2048,
        8,
    )
    assert base.dropout == 0.1
    big = TransformerConfig.from_preset("paper-big")
    assert (big.hidden_dim, big.intermediate_dim, big.num_heads, big.dropout) == (
        1024,
        4096,
        16,
        0.3,
    )
    assert TransformerConfig.from_preset("tiny", hidden_dim=32).hidden_dim == 32


def test_round_trip():
    config = TransformerConfig.from_preset("small", normalize_first=True)
    assert TransformerConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: TransformerConfig.from_preset("huge"), "Unknown preset 'huge'"),
        (lambda: TransformerConfig.from_preset("tiny", width=3), "Unknown config fields: width"),
        (lambda: TransformerConfig(num_heads=0), "num_heads=0"),
        (lambda: TransformerConfig(hidden_dim=10, num_heads=4), "divisible"),
        (lambda: TransformerConfig(dropout=1.0), "dropout"),
    ],
)
def test_bad_values(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_student_presets_and_depth_overrides():
    from keras_transformer.config import preset_config

    for name, decoder in (("student-6-1", 1), ("student-6-2", 2)):
        student = TransformerConfig.from_preset(name)
        small = TransformerConfig.from_preset("small")
        assert (student.num_encoder_layers, student.num_decoder_layers) == (6, decoder)
        assert (
            student.normalize_first and not small.normalize_first
        )  # six post-norm layers do not train
        assert (student.hidden_dim, student.intermediate_dim, student.num_heads) == (
            small.hidden_dim,
            small.intermediate_dim,
            small.num_heads,
        )
    # num_layers sets both depths, unless one is given; a given depth wins.
    config = preset_config("student-6-1", 100, num_layers=4)
    assert (config.num_encoder_layers, config.num_decoder_layers) == (4, 4)
    config = preset_config("small", 100, num_layers=4, num_decoder_layers=1)
    assert (config.num_encoder_layers, config.num_decoder_layers) == (4, 1)
    config = preset_config("student-6-2", 100, num_encoder_layers=3)
    assert (config.num_encoder_layers, config.num_decoder_layers) == (3, 2)
    with pytest.raises(ValueError, match="num_decoder_layers=0"):
        preset_config("small", 100, num_decoder_layers=0)
