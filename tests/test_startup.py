import os
import platform
import subprocess
import sys

import pytest

from keras_transformer.startup import (
    HUGE_PAGES_TUNABLE,
    MALLOC_VARIABLE,
    ONEDNN_VARIABLE,
    THP_MODE_FILE,
    configured_backend,
    huge_pages_environment,
    is_command,
)

PROBE = (
    "import os, keras_transformer\n"
    "from keras_transformer.startup import onednn_enabled\n"
    f"print(os.environ[{ONEDNN_VARIABLE!r}], onednn_enabled())\n"
)


def _probe(value):
    """What a fresh process that imports keras_transformer sees: the variable and TensorFlow's answer."""
    env = {k: v for k, v in os.environ.items() if k != ONEDNN_VARIABLE}
    env["KERAS_BACKEND"] = "tensorflow"
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    if value is not None:
        env[ONEDNN_VARIABLE] = value
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="TensorFlow's oneDNN kernels are x86's"
)
def test_importing_the_package_turns_onednn_on_unless_the_user_chose():
    # Unset: the package asks for oneDNN, and TensorFlow, loaded after it, runs it on any x86 CPU.
    assert _probe(None) == ["1", "True"]
    # The user's own choice is kept, off included.
    assert _probe("0") == ["0", "False"]


def _huge_pages_on_request():
    try:
        with open(THP_MODE_FILE, encoding="ascii") as f:
            return platform.libc_ver()[0] == "glibc" and "[madvise]" in f.read()
    except OSError:
        return False


needs_huge_pages = pytest.mark.skipif(
    not _huge_pages_on_request(), reason="glibc, with transparent huge pages on madvise"
)

FAULTS_PROBE = """
import resource
import jax, jax.numpy as jnp

grow = jax.jit(lambda x: x + 1.0)
x = jnp.zeros((24_000_000,), "float32")  # 96 MB, over the 64 MiB heaps of glibc's thread arenas
for _ in range(5):
    grow(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    grow(x).block_until_ready()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 5)
"""


def _clean_environment(**variables):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", MALLOC_VARIABLE)}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu", **variables)
    return env


@needs_huge_pages
def test_huge_pages_stop_xla_cpu_buffers_faulting_in_again_at_every_run():
    def faults_per_run(**variables):
        done = subprocess.run(
            [sys.executable, "-c", FAULTS_PROBE],
            capture_output=True,
            text=True,
            env=_clean_environment(**variables),
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        return int(done.stdout.split()[-1])

    # glibc's default: a fresh mmap for the 96 MB output at every run, each 4 KiB page faulted in.
    assert faults_per_run() > 20_000
    # In 2 MiB pages: about 450 faults a run here.
    assert faults_per_run(GLIBC_TUNABLES=HUGE_PAGES_TUNABLE) < 2_000


@needs_huge_pages
def test_the_command_starts_again_with_huge_pages_under_jax_only(tmp_path):
    # A script named as the command is: `keras-transformer`.
    command = tmp_path / "keras-transformer"
    command.write_text(
        "import os, sys\nimport keras_transformer\n"
        "print(os.environ.get('GLIBC_TUNABLES'), sys.argv[1:])\n"
    )

    def seen(**variables):
        done = subprocess.run(
            [sys.executable, str(command), "train", "--x"],
            capture_output=True,
            text=True,
            env=_clean_environment(**variables),
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().splitlines()[-1]

    assert seen(KERAS_BACKEND="jax") == f"{HUGE_PAGES_TUNABLE} ['train', '--x']"
    assert seen(KERAS_BACKEND="tensorflow") == "None ['train', '--x']"
    assert seen(KERAS_BACKEND="jax", **{MALLOC_VARIABLE: "system"}) == "None ['train', '--x']"


def test_when_the_command_starts_again():
    madvise = "always [madvise] never\n"
    assert is_command(["/venv/bin/keras-transformer", "train"])
    # python -m keras_transformer.cli, once the package is imported
    assert is_command(["/repo/keras_transformer/cli.py", "train"])
    assert not is_command(["train.py"]) and not is_command([])
    assert not is_command(["/repo/other/cli.py"])
    assert not is_command(["/repo/my_keras_transformer/cli.py"])
    again = huge_pages_environment({"JAX_PLATFORMS": "cpu"}, "jax", madvise)
    assert again == {"JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": HUGE_PAGES_TUNABLE}
    # Not: another backend, a kernel that decides alone or never, a user's own
    # glibc settings, or the user's refusal.
    assert huge_pages_environment({}, "tensorflow", madvise) is None
    assert huge_pages_environment({}, "jax", "[always] madvise never") is None
    assert huge_pages_environment({}, "jax", "always madvise [never]") is None
    assert (
        huge_pages_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "jax", madvise)
        is None
    )
    assert huge_pages_environment({MALLOC_VARIABLE: "system"}, "jax", madvise) is None


def test_the_backend_is_read_as_keras_reads_it(tmp_path):
    (tmp_path / "keras.json").write_text('{"backend": "jax"}')
    assert configured_backend({"KERAS_HOME": str(tmp_path)}) == "jax"
    assert configured_backend({"KERAS_HOME": str(tmp_path), "KERAS_BACKEND": "torch"}) == "torch"
    assert configured_backend({"KERAS_HOME": str(tmp_path / "none")}) == "tensorflow"
