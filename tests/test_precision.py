"""`--precision auto`: which policy each machine gets, and why."""

import pytest

from keras_transformer.precision import (
    check_backend_precision,
    cpu_flags,
    cpu_name,
    resolve_precision,
    training_device,
)


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
    precision, reason = resolve_precision("auto", flags=flags, gpus=gpus, backend="tensorflow")
    assert precision == expected
    assert reason.startswith("auto: ") and ("GPU" in reason) == bool(gpus)


def test_jax_on_a_bfloat16_cpu_gets_float32_and_on_a_gpu_the_gpu_decides():
    flags = {"avx512f", "avx512_bf16"}
    precision, reason = resolve_precision("auto", flags=flags, gpus=[], backend="jax")
    assert (precision, reason) == (
        "float32",
        "auto: JAX on a CPU, where XLA computes float32 faster than bfloat16",
    )
    assert resolve_precision("auto", flags=flags, gpus=[(9, 0)], backend="jax")[0] == (
        "mixed_bfloat16"
    )
    assert resolve_precision("mixed_bfloat16", flags=flags, gpus=[], backend="jax")[0] == (
        "mixed_bfloat16"
    )


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


def test_cpu_name_carries_family_and_model_that_tell_one_name_apart(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    block = "processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 1\n"
    block += "model name\t: AMD EPYC\nflags\t\t: fpu avx2\n\n"
    cpuinfo.write_text(block.format(n=0) + block.format(n=1).replace("EPYC", "other"))
    assert cpu_name(str(cpuinfo)) == "AMD EPYC (family 23, model 1)"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some CPU\n")  # no family: the name alone
    assert cpu_name(str(cpuinfo)) == "Some CPU"
    assert cpu_name(str(tmp_path / "missing")) == ""


def test_training_device_names_the_gpus_before_the_cpu():
    assert training_device([], cpu="AMD EPYC (family 25, model 17)") == (
        "AMD EPYC (family 25, model 17)"
    )
    assert training_device([], cpu="") == "unknown CPU"
    assert training_device([("NVIDIA H200", (9, 0))], cpu="x") == "NVIDIA H200"
    two = [("NVIDIA H100", (9, 0)), ("NVIDIA A100", (8, 0))]
    assert training_device(two, cpu="x") == "2 x NVIDIA A100 + NVIDIA H100"


def test_float16_under_jax_without_a_gpu_is_refused_by_name():
    with pytest.raises(ValueError, match="mixed_float16 under JAX needs a GPU"):
        check_backend_precision("mixed_float16", backend="jax", gpus=[])
    check_backend_precision("mixed_float16", backend="jax", gpus=[("H100", (9, 0))])
    check_backend_precision("mixed_float16", backend="tensorflow", gpus=[])
    for precision in ("auto", "float32", "mixed_bfloat16"):
        check_backend_precision(precision, backend="jax", gpus=[])
