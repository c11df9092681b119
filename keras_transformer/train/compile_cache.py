"""JAX's persistent compilation cache for a run: a restarted run loads its compiled train
and validation steps instead of compiling them again."""

from __future__ import annotations

import contextlib
import os
import tempfile
import zlib

import keras


def compile_cache_folder(settings, out_dir: str, process: int) -> str:
    """Where a process of the run keeps JAX's compiled programs: `--compile-cache`, else
    the run directory's `compile_cache` on process 0, and on the others a folder of the
    system's temporary directory named after the run, which outlives the start."""
    if settings.compile_cache is not None:
        return settings.compile_cache
    if process == 0:
        return os.path.join(out_dir, "compile_cache")
    run_name = zlib.crc32(os.path.abspath(out_dir).encode())
    return os.path.join(
        tempfile.gettempdir(), f"keras-transformer-compile-cache-{run_name:08x}-{process}"
    )


@contextlib.contextmanager
def compile_cache(run, settings, out_dir: str):
    """Under JAX, compiles through a persistent cache (`compile_cache_folder`) inside the
    context: a restarted run loads its train and validation steps instead of compiling
    them again. JAX's settings are restored after it."""
    if keras.backend.backend() != "jax":
        yield
        return
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    previous = {name: getattr(jax.config, name) for name in names}
    folder = compile_cache_folder(settings, out_dir, run.processes.index)
    compilation_cache.reset_cache()  # JAX opens its cache once per process otherwise
    jax.config.update("jax_compilation_cache_dir", folder)
    # Every program, even small ones: a restart then compiles nothing.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    run.log(f"Compiled programs are kept in {folder}.")
    try:
        yield
    finally:
        compilation_cache.reset_cache()
        for name, value in previous.items():
            jax.config.update(name, value)
