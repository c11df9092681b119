"""The child that passes a training process's standard error on (`train/stderr_relay.py`):
run as the training process runs it, on bytes shaped like JAX's fatal exit."""

import subprocess
import sys

from keras_transformer.train import stderr_relay

MESSAGE = "error: ended ({reason}); report {dump}"
FATAL = (
    b"F1130 12:59:40.927972   31771 client.h:80] Terminating process because the JAX "
    b"distributed service detected fatal errors. This most likely indicates that another "
    b"task died.\n*** Check failure stack trace: ***\n    @     0x7f7d5b840634  absl::Send()\n"
)


def _relay(tmp_path, data):
    folder = tmp_path / "process-1-run"
    folder.mkdir()
    cleanup, dump = tmp_path / "cleanup", tmp_path / "fatal.log"
    cleanup.write_text(f"{folder}\n")
    done = subprocess.run(
        [sys.executable, stderr_relay.__file__, MESSAGE, str(dump), str(cleanup)],
        input=data,
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0 and not done.stderr
    return done.stdout, dump, folder, cleanup


def test_output_passes_unchanged_and_nothing_is_removed_without_a_fatal_line(tmp_path):
    data = b"epoch 1\rprogress without a newline" + bytes(range(256)) * 1000 + b"\nF: not absl\n"
    out, dump, folder, cleanup = _relay(tmp_path, data)
    assert out == data
    assert not dump.exists() and folder.exists()
    assert not cleanup.exists()  # the list goes in every case


def test_a_fatal_exit_becomes_one_line_its_dump_a_file_and_the_folder_goes(tmp_path):
    before = b"Epoch 2/3\n[Gloo] Rank 1 is connected\n"
    out, dump, folder, cleanup = _relay(tmp_path, before + FATAL)
    reason = "Terminating process because the JAX distributed service detected fatal errors"
    assert out == before + f"error: ended ({reason}); report {dump}\n".encode()
    assert dump.read_bytes() == FATAL
    assert not folder.exists() and not cleanup.exists()
