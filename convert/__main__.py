"""`k3jax-convert HF_DIR OUT_DIR` (= `python -m convert`): HF Kimi K3 checkpoint -> k3jax checkpoint.
`k3jax-convert --check DIR` re-reads a converted checkpoint against its manifest (every file's size and
checksum); `k3jax-convert --write-manifest DIR` gives one to a checkpoint converted before manifests."""

from __future__ import annotations

import argparse
import os
import sys
import time

from convert.core import Options, convert


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="k3jax-convert", description=__doc__)
    ap.add_argument("hf_dir", nargs="?", help="HF checkpoint directory (config.json + safetensors shards)")
    ap.add_argument("out_dir", nargs="?", help="output directory (appears atomically when the conversion succeeds)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--check",
        metavar="DIR",
        help="verify converted checkpoint DIR against its manifest (every byte; exit 1 naming each file that differs)",
    )
    mode.add_argument(
        "--write-manifest",
        metavar="DIR",
        help="hash the files of DIR (converted before manifests) as they are now and write its manifest",
    )
    ap.add_argument(
        "--experts",
        choices=("mxfp4", "bf16"),
        default=None,
        help="keep routed experts packed MXFP4 (default when stored so) or dequantise to bf16",
    )
    ap.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="storage dtype of the bf16 trunk (fp32 tensors stay fp32, packed bytes stay packed)",
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size hint (chunking; recorded)")
    ap.add_argument(
        "--workers",
        type=int,
        default=None,
        help="reader/writer threads (I/O-latency bound; default 4, for --check/--write-manifest cores + 4)",
    )
    ap.add_argument("--resume", action="store_true", help="continue an interrupted conversion")
    ap.add_argument("--verify", action="store_true", help="re-read the output and compare it with the source")
    ap.add_argument(
        "--checksum",
        choices=("fast", "full"),
        default="fast",
        help="source checksums: sampled fingerprint (fast) or sha256 of every byte (full)",
    )
    ap.add_argument(
        "--overwrite", action="store_true", help="replace OUT_DIR if it exists (--write-manifest: replace its manifest)"
    )
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="library logs and full tracebacks on the terminal")
    a = ap.parse_args(argv)
    if a.check or a.write_manifest:
        if a.hf_dir or a.out_dir:
            ap.error("--check / --write-manifest take one checkpoint directory and no HF_DIR OUT_DIR")
        body = _check if a.check else _write_manifest
    elif not (a.hf_dir and a.out_dir):
        ap.error("give HF_DIR OUT_DIR (or --check DIR, or --write-manifest DIR)")
    else:
        body = _convert
    from k3jax import errors

    return errors.cli_main("k3jax-convert", lambda: body(a), verbose=a.verbose)


def _convert(a) -> int:
    opts = Options(
        experts=a.experts,
        dtype=a.dtype,
        tp=a.tp,
        workers=4 if a.workers is None else a.workers,
        resume=a.resume,
        verify=a.verify,
        checksum=a.checksum,
        overwrite=a.overwrite,
        progress=not a.no_progress,
    )
    t0 = time.perf_counter()
    try:
        meta = convert(a.hf_dir, a.out_dir, opts)
    except KeyboardInterrupt:  # finished parts are kept in OUT_DIR.tmp-*; nothing at OUT_DIR loads
        print(
            f"k3jax-convert: interrupted; {a.out_dir} was not written. Run the same command with --resume "
            "to continue from the finished parts",
            file=sys.stderr,
        )
        return 130
    dt = time.perf_counter() - t0
    src = meta["source"]
    nbytes = sum(int(_prod(t["shape"])) * _itemsize(t["dtype"]) for t in meta["tensors"].values())
    skipped = ", ".join(f"{n} {k}" for k, n in src["skipped"].items()) or "none"
    print(
        f"converted {src['tensors_read']} tensors into {len(meta['tensors'])} arrays "
        f"({nbytes / 1e9:.2f} GB, experts {meta['experts']}, dtype {meta['dtype']}) in {dt:.1f} s; "
        f"skipped: {skipped}; verified: {a.verify}; -> {a.out_dir}"
    )
    return 0


SHOWN = 20  # problems listed one per line by --check before the summary


def _check(a) -> int:
    from k3jax import checkpoint
    from k3jax import manifest as M

    d = a.check
    checkpoint.read_meta(d)  # a directory that is no converted checkpoint: the usual one-line refusal
    try:
        m = M.read(d)
    except M.ManifestError as e:
        raise checkpoint.CheckpointError(str(e)) from None
    if m is None:
        checkpoint.check_files(d)  # raises the refusal that says how to add one
    t0 = time.perf_counter()
    problems = M.verify(d, m, a.workers or checkpoint.default_workers(), progress=not a.no_progress)
    dt = time.perf_counter() - t0
    n, nbytes = M.count_files(m), M.total_bytes(m)
    if not problems:
        print(
            f"{d}: all {n} files match the manifest ({nbytes / 1e9:.2f} GB checked in {dt:.1f} s, "
            f"{nbytes / max(dt, 1e-9) / 1e6:.0f} MB/s)"
        )
        return 0
    for p in problems[:SHOWN]:
        print(f"  {p}", file=sys.stderr)
    if len(problems) > SHOWN:
        print(f"  ... and {len(problems) - SHOWN} more", file=sys.stderr)
    print(
        f"k3jax-convert: error: {d}: {len(problems)} of {n} files differ from the manifest (first: {problems[0]}); "
        "re-convert it (k3jax-convert HF_DIR OUT_DIR --overwrite) or copy those files again",
        file=sys.stderr,
    )
    return 1


def _write_manifest(a) -> int:
    from k3jax import checkpoint
    from k3jax import manifest as M

    d = a.write_manifest
    meta = checkpoint.read_meta(d)
    if os.path.exists(os.path.join(d, M.MANIFEST)) and not a.overwrite:
        raise checkpoint.CheckpointError(
            f"{d} already has a manifest: check it with k3jax-convert --check {d} (--overwrite replaces it with "
            "one of the files as they are now, damage included)"
        )
    t0 = time.perf_counter()
    try:
        m = M.build(d, meta.get("params", "params"), a.workers or checkpoint.default_workers(), not a.no_progress)
    except M.ManifestError as e:
        raise checkpoint.CheckpointError(f"{d}: {e}") from None
    params = meta.get("params", "params")
    missing = sorted(k for k in meta["tensors"] if f"{params}/{k.replace('/', '.')}" not in m["chunks"])
    if missing:
        raise checkpoint.CheckpointError(
            f"{d}: no array on disk for {len(missing)} tensor(s) of its metadata ({', '.join(missing[:3])}): the "
            "checkpoint is incomplete, so no manifest was written; re-convert it or copy it again"
        )
    M.write(d, m)
    dt = time.perf_counter() - t0
    nbytes = M.total_bytes(m)
    print(
        f"wrote {os.path.join(d, M.MANIFEST)}: {M.count_files(m)} files, {nbytes / 1e9:.2f} GB hashed in {dt:.1f} s "
        f"({nbytes / max(dt, 1e-9) / 1e6:.0f} MB/s); it vouches for the files as they are now"
    )
    return 0


def _prod(xs):
    out = 1
    for x in xs:
        out *= x
    return out


def _itemsize(dtype: str) -> int:
    return {"bfloat16": 2, "float32": 4, "uint8": 1}[dtype]


if __name__ == "__main__":
    sys.exit(main())
