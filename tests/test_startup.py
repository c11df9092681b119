import os
import platform
import subprocess
import sys

import pytest

from keras_transformer.startup import ONEDNN_VARIABLE

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
