"""`keras-transformer distill`: a teacher's translations of the training sources, the
data of a student (sequence-level knowledge distillation, Kim and Rush 2016).

The teacher, an ONNX export or a run directory (exported once into the
output folder), translates the source file with our own runtime, on every
core (one search per core, one thread each), in chunks of lines. After each
chunk the output files and `progress.json` (lines done and the files'
sizes) are written and synced; a run that is killed and started again cuts
the files back to the sizes `progress.json` records, so a chunk half written
is neither kept nor lost, and goes on from the next line.

The folder it writes holds `train.src` and `train.tgt`: line N of the
source and the teacher's translation of it (with `--references`, the
original pairs follow each chunk's distilled ones), ready for `train
--src-train ... --tgt-train ...` or `prepare`.
"""

from __future__ import annotations

import itertools
import json
import os

from keras_transformer.io_utils import atomic_write_text

PROGRESS = "progress.json"
FILES = ("train.src", "train.tgt")


class DistillError(Exception):
    """A teacher that does not load, or input files that do not pair up."""


def _lines(path, start=0):
    """The lines of `path` (plain or .gz) from line `start` (0-based), as a stream
    (`data.prepare.LineReader`: undecodable bytes read as U+FFFD)."""
    from keras_transformer.data.prepare import LineReader

    return itertools.islice(LineReader(path), start, None)


def _count_lines(path):
    return sum(1 for _ in _lines(path))


def teacher_translator(teacher, out_dir, threads=1):
    """An `OnnxTranslator` of `teacher`: an export folder, or a run directory exported
    into `out_dir/teacher-onnx` (once: a later run reuses it)."""
    from keras_transformer_runtime import OnnxTranslator
    from keras_transformer_runtime.export_format import MANIFEST, ExportFileError

    if not os.path.isdir(teacher):
        raise DistillError(f"the teacher {teacher} is not a folder (an export or a run directory).")
    export = teacher
    if not os.path.isfile(os.path.join(teacher, MANIFEST)):
        if not os.path.isfile(os.path.join(teacher, "model.keras")):
            raise DistillError(
                f"the teacher {teacher} holds neither an export ({MANIFEST}) nor a trained "
                "model (model.keras)."
            )
        export = os.path.join(out_dir, "teacher-onnx")
        if not os.path.isfile(os.path.join(export, MANIFEST)):
            from keras_transformer.export.onnx import export_onnx

            export_onnx(teacher, export)
    try:
        return OnnxTranslator(export, num_threads=threads)
    except (ExportFileError, ValueError, OSError) as error:
        raise DistillError(f"the teacher {export} does not load: {error}") from None


def distill(
    teacher,
    src,
    out_dir,
    tgt=None,
    beam_size=4,
    batch_size=32,
    chunk_lines=20000,
    parallel=None,
    progress=None,
):
    """Translates `src` with `teacher` into `out_dir` (see the module docstring);
    resumes where an earlier run of the same arguments stopped. Returns the
    number of source lines done.

    Args:
        teacher: an export folder or a run directory.
        src: the source file (plain or .gz), one sentence a line.
        tgt: its reference translations: with them, each chunk's original
            pairs follow its distilled ones (must have as many lines).
        beam_size: the teacher's beam (4).
        parallel: searches at once (default: the cores, one thread each).
        progress: `progress(done, total)`, told after each chunk.
    """
    from keras_transformer_runtime.onnx_sessions import available_cores
    from keras_transformer_runtime.options import SearchOptions

    for path, what in ((src, "source"), (tgt, "reference")):
        if path is not None and not os.path.isfile(path):
            raise DistillError(f"the {what} file {path} does not exist.")
    from keras_transformer.data.pipeline import DataError

    try:
        total = _count_lines(src)
        references = _count_lines(tgt) if tgt is not None else total
    except DataError as error:
        raise DistillError(str(error)) from None
    if references != total:
        raise DistillError(
            f"{src} has {total} lines and {tgt} {references}: a reference file must "
            "pair with the sources line by line."
        )
    os.makedirs(out_dir, exist_ok=True)
    settings = {"src": os.path.abspath(src), "tgt": tgt and os.path.abspath(tgt)}
    settings.update(beam_size=beam_size, teacher=os.path.abspath(teacher))
    done, sizes = _resume(out_dir, settings)
    parallel = parallel or available_cores()
    translator = teacher_translator(teacher, out_dir, threads=1 if parallel > 1 else None)
    options = SearchOptions(beam_size=beam_size)
    sources = _lines(src, done)
    references = _lines(tgt, done) if tgt is not None else None
    while done < total:
        chunk = list(itertools.islice(sources, chunk_lines))
        outputs = translator.translate(
            chunk, options=options, batch_size=batch_size, parallel_batches=parallel
        )
        pairs = list(zip(chunk, outputs, strict=True))
        if references is not None:
            pairs += list(zip(chunk, itertools.islice(references, len(chunk)), strict=True))
        sizes = _append(out_dir, pairs)
        done += len(chunk)
        atomic_write_text(
            os.path.join(out_dir, PROGRESS),
            json.dumps({**settings, "lines": done, "sizes": sizes}, indent=2) + "\n",
        )
        if progress is not None:
            progress(done, total)
    return done


def _resume(out_dir, settings):
    """`(lines done, file sizes)` of an earlier run into `out_dir`, its files cut back
    to what its progress records (a chunk half written is written again)."""
    path = os.path.join(out_dir, PROGRESS)
    if not os.path.isfile(path):
        for name in FILES:
            if os.path.exists(os.path.join(out_dir, name)):
                raise DistillError(
                    f"{out_dir} holds {name} but no {PROGRESS}: not a distillation to resume; "
                    "choose an empty folder."
                )
        return 0, [0, 0]
    with open(path, encoding="utf-8") as f:
        recorded = json.load(f)
    changed = [key for key, value in settings.items() if recorded.get(key) != value]
    if changed:
        raise DistillError(
            f"{out_dir} holds a distillation with another {changed[0]} "
            f"({recorded.get(changed[0])!r}); choose another folder to start anew."
        )
    for name, size in zip(FILES, recorded["sizes"], strict=True):
        with open(os.path.join(out_dir, name), "r+b") as f:
            f.truncate(size)
    return int(recorded["lines"]), recorded["sizes"]


def _append(out_dir, pairs):
    """Appends `pairs` to the two files, synced; their sizes after."""
    sizes = []
    for column, name in enumerate(FILES):
        with open(os.path.join(out_dir, name), "a", encoding="utf-8", newline="\n") as f:
            f.write("".join(pair[column].replace("\n", " ") + "\n" for pair in pairs))
            f.flush()
            os.fsync(f.fileno())
            sizes.append(f.tell())
    return sizes
