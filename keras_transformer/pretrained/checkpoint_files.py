"""safetensors checkpoints read and written one tensor at a time, so that an import or
an export never holds a second copy of the whole checkpoint.

`CheckpointTensors` reads a file through `safetensors.safe_open`, opened
for each read and closed after it: its memory map then never keeps the
pages it touched (they count as the process' own). `SafetensorsWriter`
(and `write_safetensors`) writes tensors as they are given: the data into
a scratch file beside the target, then the header (which must know every
shape and offset) and the data copied after it. The format (an 8-byte
little-endian header length, the JSON header, the data) is safetensors'
own; the tests read the written files back with
`safetensors.numpy.load_file`.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterable, Mapping

import numpy as np

# The safetensors names of the numpy dtypes written.
DTYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.float64): "F64",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
}


class CheckpointTensors(Mapping):
    """The tensors of a safetensors file by name, each read as float32 when asked for.

    `rows(name, start, stop)` reads rows `start:stop` of a tensor alone.
    Deleting a name only forgets it (`marian_weights.assign_weights` drops
    each tensor after its last use). Raises `ValueError` naming the file for
    one that safetensors cannot read (truncated, not safetensors).
    """

    def __init__(self, path):
        self.path = path
        with self._open() as f:
            self._names = list(f.keys())
        self._present = set(self._names)

    def _open(self):
        from safetensors import SafetensorError, safe_open

        try:
            return safe_open(self.path, framework="numpy")
        except (SafetensorError, OSError, ValueError) as error:
            raise ValueError(str(error)) from error

    def __getitem__(self, name):
        if name not in self._present:
            raise KeyError(name)
        with self._open() as f:
            return np.asarray(f.get_tensor(name), np.float32)

    def rows(self, name, start, stop):
        """Rows `start:stop` of tensor `name` (its first axis), float32."""
        if name not in self._present:
            raise KeyError(name)
        with self._open() as f:
            return np.asarray(f.get_slice(name)[start:stop], np.float32)

    def shape(self, name):
        with self._open() as f:
            return tuple(f.get_slice(name).get_shape())

    def __delitem__(self, name):
        self._present.discard(name)

    def __iter__(self):
        return (name for name in self._names if name in self._present)

    def __len__(self):
        return len(self._present)

    def __contains__(self, name):
        return name in self._present


def write_safetensors(path, tensors: Iterable[tuple[str, np.ndarray]], metadata=None):
    """Writes `(name, array)` pairs, taken one at a time, as the safetensors file `path`.

    Each array is written and let go before the next is asked for; the
    scratch data file beside `path` is removed whatever happens.
    """
    with SafetensorsWriter(path, metadata) as writer:
        for name, array in tensors:
            writer.add(name, array)


class SafetensorsWriter:
    """A safetensors file written as tensors are given (`add`), whole on leaving the
    `with` block without an exception; otherwise nothing is left."""

    def __init__(self, path, metadata=None):
        self.path = path
        self.scratch = f"{path}.data"
        self.header = {"__metadata__": dict(metadata)} if metadata else {}
        self.offset = 0
        self.data = None

    def __enter__(self):
        self.data = open(self.scratch, "wb")
        return self

    def add(self, name, array, rows=None):
        """Writes `array`, or with `rows` (indices) `array[rows]` a block of rows at a time."""
        array = np.asarray(array)
        if array.dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {array.dtype} is not written.")
        if name in self.header:
            raise ValueError(f"{name} is given twice.")
        shape = array.shape if rows is None else (len(rows), *array.shape[1:])
        start = self.offset
        blocks = [slice(None)] if rows is None else np.array_split(rows, len(rows) // 4096 + 1)
        for block in blocks:
            part = array if rows is None else array[block]
            part = np.ascontiguousarray(part, part.dtype.newbyteorder("<"))
            self.data.write(memoryview(part.reshape(-1)).cast("B"))
            self.offset += part.nbytes
        self.header[name] = {
            "dtype": DTYPES[array.dtype],
            "shape": list(shape),
            "data_offsets": [start, self.offset],
        }

    def __exit__(self, kind, error, trace):
        try:
            self.data.close()
            if kind is None:
                encoded = json.dumps(self.header, separators=(",", ":")).encode()
                encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
                with open(self.path, "wb") as out, open(self.scratch, "rb") as data:
                    out.write(struct.pack("<Q", len(encoded)))
                    out.write(encoded)
                    shutil.copyfileobj(data, out, 16 * 2**20)
        finally:
            if os.path.exists(self.scratch):
                os.remove(self.scratch)
