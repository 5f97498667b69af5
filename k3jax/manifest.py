"""A checkpoint's manifest: every file's size and checksum, so that a damaged or half-copied checkpoint is
refused instead of loading silently and decoding garbage.

`k3jax-convert` computes the checksums as it writes each chunk (from the page cache, no second pass over the
disk) and writes `k3jax_manifest.json` into the staging directory before the one rename that publishes the
checkpoint, so the manifest appears atomically with the rest. Every `k3jax.load` checks presence and sizes
against it (a directory listing and a stat per file); `verify` (`k3jax-convert --check`, `--verify-checkpoint`)
re-reads every byte on parallel threads.

    {"format": "k3jax-manifest", "version": 1, "hash": "sha256-64",
     "files":  {"k3jax_meta.json": [size, "hex"], "params/_METADATA": [...], "params/embed/.zarray": [...], ...},
     "chunks": {"params/embed": {"grid": [2, 1], "bytes": 65536, "digests": "<16 hex per chunk, C order>"}}}

Chunk files are listed per zarr array: all of an array's chunk files have one size (zarr v2 pads edge
chunks), so an array is its chunk grid, that size and its digests in grid order. The release at TP16 has ~8
million chunk files; a [size, digest] pair per path would make a ~0.7 GB manifest, this ~130 MB.

The checksum is the first 8 bytes of SHA-256 (a prefix of what `sha256sum FILE` prints): OpenSSL's SHA-256
runs on the CPU's SHA extensions (x86 since Ice Lake / Zen, ARMv8 crypto): on one core of the 2-core dev VM
0.95-1.36 GB/s against 0.41-0.67 GB/s for hashlib's blake2b when it was quiet, 0.39 against 0.25 when busy
(bench/results/check_throughput.md). 64 bits is plenty against accidental damage (not against forgery).

The size check costs a stat per file: 11-16 us per file on the dev VM (stat-bound; arrays are checked on
parallel threads), so ~2 min single-threaded there for the ~8 million files of the release at TP16, which the
restore opens one by one anyway.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

MANIFEST = "k3jax_manifest.json"
FORMAT = "k3jax-manifest"
VERSION = 1
HASH = "sha256-64"
_HASHES: dict[str, Callable] = {"sha256-64": hashlib.sha256, "blake2b-64": lambda: hashlib.blake2b(digest_size=8)}
DIGEST_HEX = 16  # 8 bytes
ZARRAY = ".zarray"
READ_BYTES = 1 << 20  # per read() while hashing: hashlib drops the GIL above 2 KB; small: one buffer per thread
GROUP_BYTES = 64 << 20  # one parallel work item: a run of chunks of one array, or one file


class ManifestError(ValueError):
    """A manifest that cannot be read or written; the message says what to do."""


# ---- hashing ---------------------------------------------------------------------------------------------

_buffers = threading.local()


def digest_file(path: str, algo: str = HASH) -> tuple[int, str]:
    """(size in bytes, hex digest) of one file, streamed through one reusable per-thread buffer."""
    buf = getattr(_buffers, "buf", None)
    if buf is None:
        buf = _buffers.buf = bytearray(READ_BYTES)
    view, h, n = memoryview(buf), _HASHES[algo](), 0
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            h.update(view[:k])
            n += k
    return n, h.hexdigest()[:DIGEST_HEX]


# ---- zarr chunk grids ------------------------------------------------------------------------------------


def chunk_key(index: tuple[int, ...]) -> str:
    """A zarr v2 chunk's file name ('.'-separated grid index; a 0-d array's one chunk is '0')."""
    return ".".join(map(str, index)) if index else "0"


def chunk_keys(grid) -> list[str]:
    """Every chunk's file name in C order (string products: ~3x faster than chunk_key per index)."""
    return [".".join(p) for p in itertools.product(*[[str(i) for i in range(g)] for g in grid])] if grid else ["0"]


def chunk_grid(shape, chunks) -> tuple[int, ...]:
    return tuple(-(-s // c) for s, c in zip(shape, chunks, strict=True))


def _index_at(flat: int, grid: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for g in reversed(grid):
        flat, r = divmod(flat, g)
        out.append(r)
    return tuple(reversed(out))


def _flat(index: tuple[int, ...], grid: tuple[int, ...]) -> int:
    f = 0
    for i, g in zip(index, grid, strict=True):
        f = f * g + i
    return f


class ArrayDigests:
    """The digests of one zarr array's chunk files, filled in as the converter writes them."""

    def __init__(self, rel: str, shape, chunks, itemsize: int):
        self.rel, self.grid = rel, chunk_grid(shape, chunks)
        self.bytes = math.prod(chunks) * itemsize
        self.digests: list[str | None] = [None] * math.prod(self.grid)

    def add(self, index: tuple[int, ...], root: str) -> None:
        size, d = digest_file(os.path.join(root, self.rel, chunk_key(index)))
        if size != self.bytes:  # the storage layer wrote something other than a raw chunk: never publish it
            raise ManifestError(f"{self.rel}/{chunk_key(index)} has {size} bytes, expected {self.bytes}")
        self.digests[_flat(index, self.grid)] = d

    def entry(self) -> dict:
        missing = [chunk_key(_index_at(i, self.grid)) for i, d in enumerate(self.digests) if d is None]
        if missing:
            raise ManifestError(f"{self.rel}: chunks {missing[:3]} were never written")
        return {"grid": list(self.grid), "bytes": self.bytes, "digests": "".join(self.digests)}


# ---- reading, writing, building --------------------------------------------------------------------------


def read(ckpt_dir: str) -> dict | None:
    """The manifest, or None where the checkpoint has none (converted before manifests existed)."""
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            m = json.load(f)
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path} is unreadable ({e}); run k3jax-convert --write-manifest or re-convert") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("hash") not in _HASHES:
        raise ManifestError(f"{path} is not a k3jax manifest this code can read (hash {m.get('hash')!r})")
    if m.get("version") != VERSION:
        raise ManifestError(f"{path}: manifest version {m.get('version')}, this code reads {VERSION}")
    return m


def assemble(files: dict[str, list], chunks: dict[str, dict]) -> dict:
    return {"format": FORMAT, "version": VERSION, "hash": HASH, "files": files, "chunks": chunks}


def write(ckpt_dir: str, m: dict) -> None:
    """Write the manifest atomically (a temporary file, fsync, rename)."""
    path = os.path.join(ckpt_dir, MANIFEST)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(m, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def build(ckpt_dir: str, params: str = "params", workers: int = 4, progress: bool | None = None) -> dict:
    """Hash a checkpoint as it is now (`k3jax-convert --write-manifest`): every zarr array under `params/`
    becomes a chunk grid, every other file a [size, digest] pair. Refuses arrays with missing or odd-sized
    chunk files: those are incomplete checkpoints, and a manifest would only bless the damage."""
    files, arrays, total = {}, [], 0
    for dirpath, dirnames, filenames in os.walk(ckpt_dir):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, ckpt_dir)
        rel_dir = "" if rel_dir == "." else rel_dir
        names = set(filenames)
        if ZARRAY in names and rel_dir.split(os.sep)[0] == params:
            rel = rel_dir.replace(os.sep, "/")
            with open(os.path.join(dirpath, ZARRAY)) as f:
                z = json.load(f)
            grid, size = chunk_grid(z["shape"], z["chunks"]), math.prod(z["chunks"]) * _zarr_itemsize(z["dtype"])
            keys = chunk_keys(grid)
            for k in keys:
                p = os.path.join(dirpath, k)
                if not os.path.exists(p) or os.path.getsize(p) != size:
                    what = "missing" if not os.path.exists(p) else f"{os.path.getsize(p)} bytes, expected {size}"
                    raise ManifestError(
                        f"{rel}/{k} is {what}: the checkpoint is incomplete, so no manifest was written; "
                        "re-convert it (k3jax-convert ... --overwrite) or copy it again"
                    )
            arrays.append((rel, grid, size))
            total += size * len(keys)
            names -= set(keys)
        for name in sorted(names):
            rel = f"{rel_dir}/{name}".lstrip("/").replace(os.sep, "/")
            if rel == MANIFEST or rel.startswith(MANIFEST + ".tmp-"):
                continue
            files[rel] = None
            total += os.path.getsize(os.path.join(dirpath, name))
    bar = _Bar(total, "manifest", progress)
    for rel, (size, d) in zip(files, _map(lambda r: _digest_counted(ckpt_dir, r, bar), files, workers), strict=True):
        files[rel] = [size, d]
    groups = [(rel, grid, size, a, b) for rel, grid, size in arrays for a, b in _groups(math.prod(grid), size)]
    digests = {rel: [] for rel, _, _ in arrays}
    for (rel, *_), ds in zip(groups, _map(lambda g: _digest_group(ckpt_dir, g, bar), groups, workers), strict=True):
        digests[rel].extend(ds)
    bar.close()
    chunks = {rel: {"grid": list(grid), "bytes": size, "digests": "".join(digests[rel])} for rel, grid, size in arrays}
    return assemble(files, chunks)


def _zarr_itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else int(dtype[2:]) if dtype[:1] in "<>|" else {"bool": 1}[dtype]


def _digest_counted(root: str, rel: str, bar) -> tuple[int, str]:
    out = digest_file(os.path.join(root, rel))
    bar.update(out[0])
    return out


def _digest_group(root: str, g, bar) -> list[str]:
    rel, grid, size, a, b = g
    out = [digest_file(os.path.join(root, rel, chunk_key(_index_at(i, grid))))[1] for i in range(a, b)]
    bar.update((b - a) * size)
    return out


# ---- checking --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One file that differs from the manifest: its path inside the checkpoint and what is wrong."""

    path: str
    what: str

    @property
    def tensor(self) -> str | None:
        """The weight tensor (zarr array = dotted parameter path) the file belongs to, if any."""
        parts = self.path.split("/")
        return parts[1] if len(parts) == 3 and parts[0] == "params" else None

    def __str__(self) -> str:
        return f"{self.path}" + (f" (tensor {self.tensor})" if self.tensor else "") + f": {self.what}"


def count_files(m: dict) -> int:
    return len(m["files"]) + sum(math.prod(c["grid"]) for c in m["chunks"].values())


def total_bytes(m: dict) -> int:
    return sum(s for s, _ in m["files"].values()) + sum(c["bytes"] * math.prod(c["grid"]) for c in m["chunks"].values())


def check_sizes(ckpt_dir: str, m: dict, workers: int = 8) -> list[Problem]:
    """Every listed file present with its listed size: a listing of each array's directory and one stat per
    file, on `workers` threads (no data is read)."""
    problems = []
    for rel, (size, _) in m["files"].items():
        try:
            got = os.stat(os.path.join(ckpt_dir, rel)).st_size
        except FileNotFoundError:
            problems.append(Problem(rel, "missing"))
            continue
        if got != size:
            problems.append(Problem(rel, f"{got} bytes, the manifest says {size} (truncated or replaced)"))
    for found in _map(lambda item: _check_array_sizes(ckpt_dir, *item), m["chunks"].items(), workers):
        problems.extend(found)
    return problems


def _check_array_sizes(root: str, rel: str, c: dict) -> list[Problem]:
    try:
        with os.scandir(os.path.join(root, rel)) as it:
            sizes = {e.name: e.stat().st_size for e in it if e.name != ZARRAY}
    except FileNotFoundError:
        return [Problem(f"{rel}/", "the whole array's directory is missing")]
    out = []
    for k in chunk_keys(c["grid"]):
        got = sizes.get(k)
        if got is None:
            out.append(Problem(f"{rel}/{k}", "missing"))
        elif got != c["bytes"]:
            out.append(Problem(f"{rel}/{k}", f"{got} bytes, the manifest says {c['bytes']} (truncated or replaced)"))
    return out


def verify(ckpt_dir: str, m: dict, workers: int = 4, progress: bool | None = None) -> list[Problem]:
    """Sizes, then every byte against its checksum, streamed on `workers` threads with a byte progress bar.
    Returns the files that differ (missing and wrong-sized ones are reported without being read)."""
    problems = check_sizes(ckpt_dir, m, workers)
    bad = {p.path for p in problems}
    algo = m["hash"]
    items: list[tuple] = [("file", rel, size, d) for rel, (size, d) in m["files"].items() if rel not in bad]
    for rel, c in m["chunks"].items():
        if f"{rel}/" in bad:
            continue
        for a, b in _groups(math.prod(c["grid"]), c["bytes"]):
            items.append(("chunks", rel, c, a, b))
    bar = _Bar(sum(_item_bytes(it) for it in items), "check", progress)

    def run(it) -> list[Problem]:
        out = []
        if it[0] == "file":
            _, rel, size, want = it
            if digest_file(os.path.join(ckpt_dir, rel), algo)[1] != want:
                out.append(Problem(rel, "checksum differs (bytes changed since conversion)"))
        else:
            _, rel, c, a, b = it
            grid = tuple(c["grid"])
            for i in range(a, b):
                k = chunk_key(_index_at(i, grid))
                path = f"{rel}/{k}"
                if path in bad:
                    continue
                want = c["digests"][i * DIGEST_HEX : (i + 1) * DIGEST_HEX]
                if digest_file(os.path.join(ckpt_dir, rel, k), algo)[1] != want:
                    out.append(Problem(path, "checksum differs (bytes changed since conversion)"))
        bar.update(_item_bytes(it))
        return out

    for found in _map(run, items, workers):
        problems.extend(found)
    bar.close()
    return problems


def _item_bytes(it) -> int:
    return it[2] if it[0] == "file" else (it[4] - it[3]) * it[2]["bytes"]


def _groups(n: int, size: int) -> Iterable[tuple[int, int]]:
    """Runs [a, b) of an array's n chunks holding about GROUP_BYTES each: parallel items with little overhead."""
    step = max(1, GROUP_BYTES // max(size, 1))
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def _map(fn, items, workers: int) -> list:
    """fn over items on `workers` threads (hashlib and file reads release the GIL), results in order."""
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [fn(it) for it in items]
    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(fn, items))


class _Bar:
    """Thread-safe tqdm byte counter on stderr (MB/s); `on=None` shows it only on a terminal."""

    def __init__(self, total: int, desc: str, on: bool | None):
        self.lock, self.bar, self.t0, self.n = threading.Lock(), None, time.perf_counter(), 0
        if on is not False:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                desc=desc,
                file=sys.stderr,
                disable=None if on is None else False,
                smoothing=0.1,
            )

    def update(self, n: int):
        with self.lock:
            self.n += n
            if self.bar is not None:
                self.bar.update(n)

    def close(self):
        if self.bar is not None:
            self.bar.close()
