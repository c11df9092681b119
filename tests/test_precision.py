"""`--precision auto`: which policy each machine gets, and why."""

import pytest

from keras_transformer.precision import cpu_flags, resolve_precision


@pytest.mark.parametrize(
    "flags,gpus,expected",
    [
        ({"avx2", "fma"}, [], "float32"),  # Zen 3: bfloat16 would be emulated
        ({"avx512f", "avx512_bf16"}, [], "mixed_bfloat16"),  # Zen 4, Cooper Lake
        ({"avx512f", "amx_bf16", "amx_tile"}, [], "mixed_bfloat16"),  # Sapphire Rapids
        ({"avx512f"}, [], "float32"),  # Skylake-SP: AVX-512 without bfloat16
        ({"avx2"}, [(9, 0)], "mixed_bfloat16"),  # H100: the GPU decides, not the CPU
        ({"avx512_bf16"}, [(7, 5)], "float32"),  # T4: no bfloat16 tensor cores
        ({"avx2"}, [(8, 0), (7, 0)], "float32"),  # the slowest GPU decides
    ],
)
def test_auto_picks_bfloat16_only_where_hardware_computes_it(flags, gpus, expected):
    precision, reason = resolve_precision("auto", flags=flags, gpus=gpus)
    assert precision == expected
    assert reason.startswith("auto: ") and ("GPU" in reason) == bool(gpus)


@pytest.mark.parametrize("requested", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_an_explicit_precision_is_kept(requested):
    assert resolve_precision(requested, flags={"amx_bf16"}, gpus=[]) == (requested, "requested")


def test_unknown_precision_names_the_choices():
    with pytest.raises(ValueError, match="precision must be one of auto, float32.*'bf16'"):
        resolve_precision("bf16")


def test_cpu_flags_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\nbugs\t\t: spectre\n")
    assert cpu_flags(str(cpuinfo)) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == set()
