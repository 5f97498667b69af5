"""Minimal safetensors reading and writing, lazy and streaming.

We parse headers ourselves (8-byte little-endian length + JSON) so that every shard can be validated (dtype,
shape, byte ranges, file length) before a single tensor is read, and we read tensors, or row blocks of them,
with `os.pread` straight into NumPy (bf16 through ml_dtypes; the safetensors NumPy backend has no bf16).
The writer knows every shape up front, writes the header first, then streams tensor data in order.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "U8": np.uint8,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
    "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}
ST_NAME = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "uint8": "U8"}  # our dtype -> safetensors
MAX_HEADER = 1 << 30


class ShardError(ValueError):
    """A shard that cannot be read as safetensors; the message names the file."""


@dataclass(frozen=True)
class Entry:
    """Where one tensor lives: file, safetensors dtype name, shape, absolute byte range."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def np_dtype(self):
        return np.dtype(DTYPES[self.dtype])

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: str) -> dict[str, Entry]:
    """Parse and validate one shard's header against the file length (catches truncated/corrupt files)."""
    fname = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ShardError(f"{fname}: truncated safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise ShardError(f"{fname}: corrupt safetensors header (header length {n}, file size {size})")
        raw = f.read(n)
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardError(f"{fname}: corrupt safetensors header (not JSON: {e})") from None
    if not isinstance(meta, dict):
        raise ShardError(f"{fname}: corrupt safetensors header (not a JSON object)")
    base = 8 + n
    out = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (lo, hi) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ShardError(f"{fname}: corrupt header entry for tensor {name!r}: {info!r}") from None
        if dtype not in DTYPES:
            raise ShardError(f"{fname}: tensor {name!r} has unknown safetensors dtype {dtype!r}")
        want = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize
        if hi - lo != want or lo < 0:
            raise ShardError(
                f"{fname}: tensor {name!r} byte range [{lo}, {hi}) does not match {dtype}{list(shape)} ({want} bytes)"
            )
        if base + hi > size:
            raise ShardError(f"{fname}: truncated: tensor {name!r} ends at byte {base + hi}, file has {size} bytes")
        out[name] = Entry(name, path, dtype, shape, base + lo, base + hi)
    return out


def read(entry: Entry, rows: tuple[int, int] | None = None) -> np.ndarray:
    """The tensor (or rows [r0, r1) of its first axis), read lazily from disk."""
    shape = entry.shape
    lo, hi = entry.start, entry.end
    if rows is not None:
        row_bytes = (entry.end - entry.start) // max(shape[0], 1)
        lo, hi = entry.start + rows[0] * row_bytes, entry.start + rows[1] * row_bytes
        shape = (rows[1] - rows[0],) + shape[1:]
    buf = bytearray(hi - lo)
    mv = memoryview(buf)
    fd = os.open(entry.file, os.O_RDONLY)
    try:
        got = 0
        while got < len(buf):  # pread may return short reads for large ranges
            k = os.preadv(fd, [mv[got:]], lo + got)
            if not k:
                raise ShardError(f"{os.path.basename(entry.file)}: truncated while reading {entry.name!r}")
            got += k
    finally:
        os.close(fd)
    return np.frombuffer(buf, entry.np_dtype).reshape(shape)


class Writer:
    """Streams one safetensors file: `Writer(path, {name: (st_dtype, shape)})`, then `write(name, array)`
    in the declared order (any order of declaration; data order = declaration order)."""

    def __init__(self, path: str, specs: dict[str, tuple[str, tuple[int, ...]]], metadata=None):
        header, off = {}, 0
        if metadata:
            header["__metadata__"] = metadata
        for name, (dt, shape) in specs.items():
            n = math.prod(shape) * np.dtype(DTYPES[dt]).itemsize
            header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the reference writer does
        self.order = list(specs)
        self.specs = specs
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(raw)) + raw)
        self.i = 0

    def write(self, name: str, arr: np.ndarray):
        want = self.order[self.i]
        dt, shape = self.specs[want]
        if name != want or tuple(arr.shape) != tuple(shape) or arr.dtype != np.dtype(DTYPES[dt]):
            raise ValueError(f"writer expected {want} {dt}{list(shape)}, got {name} {arr.dtype}{list(arr.shape)}")
        self.f.write(np.ascontiguousarray(arr).tobytes())
        self.i += 1

    def close(self):
        if self.i != len(self.order):
            raise ValueError(f"writer closed after {self.i} of {len(self.order)} tensors")
        self.f.close()
