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
