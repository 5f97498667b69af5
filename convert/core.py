"""HF K3 checkpoint -> k3jax checkpoint (orbax params + k3jax_meta.json), streaming, resumable, atomic.

Flow: open and validate every header (no data read, nothing written on error) -> one job per table entry,
grouped into parts (the globals, then one part per layer) -> N worker threads read source tensors lazily
(one stack entry or row block at a time, so host memory is bounded by workers x block size, not by the
model) and write them into a staging directory `OUT_DIR.tmp-<hash>` -> a part's marker is written when all
its leaves are on disk (with their chunks' checksums, taken right after each block is written), so `--resume`
skips finished parts -> metadata, tokenizer files, optional verify -> the manifest (k3jax/manifest.py: every
file's size and checksum) -> one rename to OUT_DIR. A crash leaves only the staging directory, which
`k3jax.load` refuses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from convert import store
from convert.safetensors_io import ShardError, read
from convert.source import ConvertError, Source, check, fingerprint, open_source
from k3jax import manifest as M
from k3jax import params as P
from k3jax import sharding, transforms

META = "k3jax_meta.json"
FORMAT = "k3jax-checkpoint"
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json")


@dataclass(frozen=True)
class Options:
    experts: str | None = None  # 'mxfp4' (keep packed) | 'bf16' (dequantise); default: as stored
    dtype: str = "bfloat16"  # storage dtype of the bf16 trunk; fp32 tensors and packed bytes are kept
    tp: int = 1  # tensor-parallel hint: chunk boundaries follow the TP split, recorded in the metadata
    workers: int = 2
    resume: bool = False
    verify: bool = False
    checksum: str = "fast"  # 'fast' | 'full' (sha256 of every byte)
    overwrite: bool = False
    block_bytes: int = 256 << 20  # largest row block read at once from an unstacked tensor
    progress: bool = True


def _warn_stale_stages(out_dir: str, stage: str) -> None:
    """Interrupted conversions into out_dir with other options (another --tp, --dtype, source...) keep their
    staging directories for their own --resume; at release size each can hold ~1.4 TB, so name them."""
    parent, prefix = os.path.dirname(out_dir), os.path.basename(out_dir) + ".tmp-"
    others = sorted(
        os.path.join(parent, d) for d in os.listdir(parent) if d.startswith(prefix) and os.path.join(parent, d) != stage
    )
    if others:
        print(
            f"warning: interrupted conversions into {out_dir} with other options keep their finished parts in "
            f"{', '.join(others)}; resume them with their own options, or delete them to free the disk",
            file=sys.stderr,
        )


def convert(
    hf_dir: str, out_dir: str, opts: Options = Options(), _after_part: Callable[[str], None] | None = None
) -> dict:
    """Convert; returns the metadata dict written to OUT_DIR/k3jax_meta.json.

    `_after_part(part)` is a test hook, called after each part's marker is written."""
    if opts.dtype not in ("bfloat16", "float32"):
        raise ConvertError(f"--dtype must be bfloat16 or float32, got {opts.dtype!r}")
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not opts.overwrite:
        raise ConvertError(f"{out_dir} already exists (pass --overwrite to replace it)")
    src = open_source(hf_dir)
    cfg = src.cfg
    experts = opts.experts or ("mxfp4" if cfg.expert_quant == "mxfp4" else "bf16")
    if experts == "mxfp4" and cfg.expert_quant != "mxfp4":
        raise ConvertError(
            "--experts mxfp4 needs MXFP4 experts in the source; this checkpoint stores bf16 "
            "experts (re-quantising would change the weights)"
        )
    try:  # the hint sets chunk boundaries; one that no mesh can use would be recorded and silently useless
        sharding.validate_tp(cfg, opts.tp)
    except sharding.ShardingError as e:
        raise ConvertError(f"--tp: {e}") from None
    table = P.tensor_table(cfg, experts)
    skipped = check(src, table)
    source_files = {f: fingerprint(os.path.join(hf_dir, f), opts.checksum == "full") for f in src.files}
    job_id = hashlib.sha256(
        json.dumps([cfg.to_hf(), experts, opts.dtype, opts.tp, opts.block_bytes, source_files], sort_keys=True).encode()
    ).hexdigest()[:12]
    stage = f"{out_dir}.tmp-{job_id}"
    _warn_stale_stages(out_dir, stage)
    params_dir, parts_dir = os.path.join(stage, "params"), os.path.join(stage, "parts")
    if os.path.exists(stage) and not opts.resume:
        if not opts.overwrite:  # hours of finished parts: never thrown away without being asked
            raise ConvertError(
                f"{stage} holds an interrupted conversion of this source with these options: "
                "pass --resume to continue it, or --overwrite to start over"
            )
        shutil.rmtree(stage)
    os.makedirs(params_dir, exist_ok=True)
    os.makedirs(parts_dir, exist_ok=True)

    jobs = [
        Job(
            spec,
            src,
            _store_dtype(spec, opts.dtype),
            *store.chunk_shape(spec, _store_dtype(spec, opts.dtype), opts.tp, opts.block_bytes),
        )
        for spec in table
    ]
    parts: dict[str, list[Job]] = {}
    for j in jobs:
        parts.setdefault(_part(j.spec), []).append(j)
    digests = {p: d for p in parts if (d := _read_marker(parts_dir, p)) is not None}  # finished parts
    done = set(digests)
    todo = [j for p, js in parts.items() if p not in done for j in js]
    try:
        bar = _Progress(sum(j.src_bytes for j in todo), "convert", opts.progress)
        if done:
            print(f"resuming: {len(done)} of {len(parts)} parts already converted", file=sys.stderr)
        remaining = {p: len(js) for p, js in parts.items() if p not in done}
        lock = threading.Lock()

        def run(j: Job):
            files, chunks = j.write(params_dir, bar)
            with lock:
                p = _part(j.spec)
                d = digests.setdefault(p, {"files": {}, "chunks": {}})
                d["files"].update(files)
                d["chunks"].update(chunks)
                remaining[p] -= 1
                finished = remaining[p] == 0
            if finished:
                _write_marker(parts_dir, p, d)
                if _after_part:
                    _after_part(p)

        _pool(run, todo, opts.workers)
        bar.close()
        store.write_metadata(params_dir, table)
        meta = {
            "format": FORMAT,
            "table_version": P.TABLE_VERSION,
            "config": cfg.to_hf(),
            "experts": experts,
            "dtype": opts.dtype,
            "tp": opts.tp,
            "params": "params",
            "tensors": {j.spec.key: {"shape": list(j.spec.shape), "dtype": j.dtype} for j in jobs},
            "source": {
                "dir": os.path.abspath(hf_dir),
                "checksum": opts.checksum,
                "files": source_files,
                "tensors_read": len(src.entries) - sum(skipped.values()),
                "skipped": skipped,
            },
            "tokenizer": [],
        }
        for name in TOKENIZER_FILES:
            if os.path.exists(os.path.join(hf_dir, name)):
                shutil.copy2(os.path.join(hf_dir, name), os.path.join(stage, name))
                meta["tokenizer"].append(name)
            else:
                print(f"warning: {name} not in {hf_dir}; the checkpoint has no tokenizer file", file=sys.stderr)
        if opts.verify:
            vbar = _Progress(sum(j.src_bytes for j in jobs), "verify", opts.progress)
            _pool(lambda j: j.verify(params_dir, vbar), jobs, opts.workers)
            vbar.close()
        with open(os.path.join(stage, META), "w") as f:
            json.dump(meta, f, indent=1)
        files = {n: list(M.digest_file(os.path.join(stage, n))) for n in [META, *meta["tokenizer"]]}
        for n in ("_METADATA", "_CHECKPOINT_METADATA"):
            files[f"params/{n}"] = list(M.digest_file(os.path.join(params_dir, n)))
        chunks = {}
        for p in parts:
            files.update(digests[p]["files"])
            chunks.update(digests[p]["chunks"])
        M.write(stage, M.assemble(dict(sorted(files.items())), dict(sorted(chunks.items()))))
        shutil.rmtree(parts_dir)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.rename(stage, out_dir)  # the one atomic step: before it nothing loads, after it all of it does
    except (ConvertError, ShardError, M.ManifestError) as e:  # bad data: nothing to resume, leave nothing behind
        shutil.rmtree(stage, ignore_errors=True)
        raise ConvertError(str(e)) from None
    return meta


def _read_marker(parts_dir: str, part: str) -> dict | None:
    """A finished part's checksums, or None where the part must be (re)done: no marker, or an empty one left
    by a converter from before manifests (its chunks were never hashed)."""
    try:
        with open(os.path.join(parts_dir, part + ".done")) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and {"files", "chunks"} <= d.keys() else None


def _write_marker(parts_dir: str, part: str, digests: dict) -> None:
    """Atomically: a marker is the promise that the part's files and checksums are complete."""
    path = os.path.join(parts_dir, part + ".done")
    with open(path + ".tmp", "w") as f:
        json.dump(digests, f)
    os.replace(path + ".tmp", path)


def _store_dtype(spec: P.TensorSpec, dtype: str) -> str:
    return dtype if spec.dtype == "bfloat16" else spec.dtype


def _part(spec: P.TensorSpec) -> str:
    return f"layer{spec.path[1]:03d}" if spec.path[0] == "layers" else "globals"


def _pool(fn, items, workers: int):
    """Run fn over items on `workers` threads; the first exception cancels the rest and is re-raised."""
    ex = ThreadPoolExecutor(max(1, workers))
    try:
        futs = [ex.submit(fn, it) for it in items]
        wait(futs, return_when=FIRST_EXCEPTION)
        for f in futs:
            if f.done() and f.exception() is not None:
                raise f.exception()
    finally:
        # on an error or Ctrl-C only the jobs already running finish (a plain `with` would run the whole queue
        # first: an hour for the release); their unfinished parts stay unmarked, so --resume redoes them
        ex.shutdown(wait=True, cancel_futures=True)


_EXPONENT_BITS = {"bfloat16": 0x7F80, "float16": 0x7C00, "float32": 0x7F800000}  # all ones: inf or NaN


@dataclass
class Job:
    """One table entry: where its HF tensors are, how to stream them, what to write."""

    spec: P.TensorSpec
    src: Source
    dtype: str
    chunks: tuple[int, ...]
    axis: int

    @property
    def src_bytes(self) -> int:
        n = 0
        for t in self.spec.hf_names:
            e = self.src.entry(t)
            n += e.nbytes
            if self.spec.transform == "dequant":
                n += self.src.entries[self.src.name(t).removesuffix("_packed") + "_scale"].nbytes
        return n // (2 if self.spec.transform.startswith("kvb_") else 1)  # kv_b is read by two entries

    def blocks(self) -> Iterator[tuple[tuple, np.ndarray, int]]:
        """(index into our array, our values in the storage dtype, source bytes read), bounded in size."""
        spec = dataclasses.replace(self.spec, dtype=self.dtype)  # cast once, straight to the storage dtype
        names = [self.src.name(t) for t in spec.hf_names]
        if spec.stack is not None:
            for i, name in enumerate(names):
                a, c, n = self._read(name)
                yield (i,), transforms.from_hf(spec, [a], [c])[0], n
            return
        e = self.src.entries[names[0]]
        step, shape = self.chunks[self.axis], spec.shape
        streamable = {  # HF rows map to whole indices of our streamed axis (store.chunk_shape picks it)
            "copy": e.shape == shape,
            # whole HF rows per index: o [D, H, K] (one row an index), MLA g [H, Vd, D] (Vd rows a head)
            "reshape": len(shape) > 1 and e.shape[0] % shape[0] == 0 and np.prod(e.shape) == np.prod(shape),
            "T": e.shape == (int(np.prod(shape[1:])), shape[0]),
        }.get(spec.transform, False)
        if not streamable or step >= shape[self.axis]:
            a, c, n = self._read(names[0])
            yield (), transforms.from_hf(spec, [a], [c]), n
            return
        inner = e.shape[0] // spec.shape[self.axis]  # HF rows per index of the streamed axis (T: head dims)
        for r0 in range(0, spec.shape[self.axis], step):
            r1 = min(r0 + step, spec.shape[self.axis])
            a = read(e, (r0 * inner, r1 * inner))
            if spec.transform == "T":
                out = np.ascontiguousarray(a.T).reshape((spec.shape[0], r1 - r0) + spec.shape[2:])
                yield (slice(None), slice(r0, r1)), out.astype(store.np_dtype(self.dtype)), a.nbytes
            else:
                yield (
                    (slice(r0, r1),),
                    a.reshape((r1 - r0,) + spec.shape[1:]).astype(store.np_dtype(self.dtype)),
                    a.nbytes,
                )

    def _read(self, name: str):
        a = read(self.src.entries[name])
        if self.spec.transform != "dequant":
            return a, None, a.nbytes // (2 if self.spec.transform.startswith("kvb_") else 1)
        c = read(self.src.entries[name.removesuffix("_packed") + "_scale"])
        return a, c, a.nbytes + c.nbytes

    def write(self, params_dir: str, bar) -> tuple[dict, dict]:
        """Write the array block by block, hashing each block's chunk files right after it is written (they are
        in the page cache: no second pass over the disk). Returns the manifest's (files, chunks) entries."""
        t = store.open_leaf(params_dir, self.spec, self.dtype, self.chunks, create=True)
        root, rel = os.path.dirname(params_dir), "params/" + store.leaf_name(self.spec.path)
        digests = M.ArrayDigests(rel, self.spec.shape, self.chunks, store.np_dtype(self.dtype).itemsize)
        for idx, arr, n in self.blocks():
            self._check_values(arr)
            t[idx].write(arr).result()
            for c in store.covered_chunks(idx, self.spec.shape, self.chunks):
                digests.add(c, root)
            bar.update(n)
        zarray = M.digest_file(os.path.join(root, rel, M.ZARRAY))
        return {f"{rel}/{M.ZARRAY}": list(zarray)}, {rel: digests.entry()}

    def _check_values(self, arr: np.ndarray):
        """Bit rot or a bad download with intact headers passes every header check, and a flipped bit most
        often lands in an exponent: refuse inf/NaN weights and NaN E8M0 scales (0xFF) instead of writing a
        checkpoint that decodes garbage. Integer compares on the exponent bits: cheap next to the read."""
        if arr.dtype.name in _EXPONENT_BITS:
            bits = _EXPONENT_BITS[arr.dtype.name]
            bad = (arr.view(f"u{arr.itemsize}") & bits) == bits
        elif self.spec.init == "scales":
            bad = arr == 0xFF
        else:  # packed E2M1 codes: every byte is a valid pair of weights
            return
        if bad.any():
            entries = [self.src.entries[self.src.name(h)] for h in self.spec.hf_names]
            where = ", ".join(sorted({f"{e.name} in {os.path.basename(e.file)}" for e in entries})[:2])
            raise ConvertError(
                f"{where}: {int(bad.sum())} inf/NaN value(s) (as {self.spec.key}); the shard is "
                "corrupt: download it again"
            )

    def verify(self, params_dir: str, bar):
        t = store.open_leaf(params_dir, self.spec, self.dtype, self.chunks, create=False)
        for idx, want, n in self.blocks():
            got = t[idx].read().result()
            if got.shape != want.shape or not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
                names = ", ".join(self.src.name(h) for h in self.spec.hf_names[:2])
                raise ConvertError(f"--verify: output {self.spec.key} {idx} differs from its source ({names})")
            bar.update(n)


class _Progress:
    """Thread-safe tqdm byte counter (shows MB/s); silent when progress is off."""

    def __init__(self, total: int, desc: str, on: bool):
        self.lock = threading.Lock()
        self.n = 0
        self.bar = None
        if on:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=desc, smoothing=0.1)

    def update(self, n: int):
        with self.lock:
            self.n += n
            if self.bar is not None:
                self.bar.update(n)

    def close(self):
        if self.bar is not None:
            self.bar.close()
