"""`k3jax-convert --check` throughput: verify a converted checkpoint of a few hundred MB against its manifest.

    PYTHONPATH=. python bench/check_throughput.py [--workdir /tmp/k3check] [--mb 512] [--workers 1 2 4]

The checkpoint is the tiny K3 with a vocabulary large enough that the embedding and lm_head hold ~--mb MB
(chunk files of up to 256 MiB, as the converter cuts the release's large tensors), converted by the real
converter. Each worker count is timed twice: warm (the files in the page cache: the hashing rate, what a
machine with disks faster than its cores gets) and cold (each file's pages dropped first with
posix_fadvise(DONTNEED): the disk's rate). Also the single-core rate of the two candidate hashes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import time

from convert.core import Options, convert
from convert.fake_hf import write_fake_hf
from k3jax import manifest as M
from k3jax.config import preset


def _drop_cache(d: str) -> None:
    for root, _, files in os.walk(d):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _hash_rates(mb: int = 256) -> dict:
    buf = os.urandom(mb << 20)
    out = {}
    for name, new in (("sha256", hashlib.sha256), ("blake2b", hashlib.blake2b)):
        best = 0.0
        for _ in range(3):  # best of 3: the machine is shared
            t0 = time.perf_counter()
            new(buf).digest()
            best = max(best, len(buf) / (time.perf_counter() - t0) / 1e6)
        out[name] = round(best)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/k3check")
    ap.add_argument("--mb", type=int, default=512, help="approximate checkpoint size in MB")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeat", type=int, default=5, help="runs per setting; the median is reported")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    shutil.rmtree(a.workdir, ignore_errors=True)
    hf, ck = os.path.join(a.workdir, "hf"), os.path.join(a.workdir, "ck")
    cfg = preset("tiny")
    cfg = cfg.replace(vocab_size=(a.mb << 20) // (2 * 2 * cfg.hidden_size))  # embed + lm_head, bf16
    write_fake_hf(hf, cfg, seed=0, shards=4)
    t0 = time.perf_counter()
    convert(hf, ck, Options(progress=False, workers=2))
    convert_s = time.perf_counter() - t0
    shutil.rmtree(hf)
    m = M.read(ck)
    nbytes, nfiles = M.total_bytes(m), M.count_files(m)
    biggest = max(c["bytes"] for c in m["chunks"].values())
    runs, load0 = [], os.getloadavg()[0]
    for w in a.workers:
        for cache in ("warm", "cold"):
            secs = []
            for _ in range(a.repeat):
                if cache == "cold":
                    os.sync()
                    _drop_cache(ck)
                else:
                    M.verify(ck, m, w, progress=False)  # read once: the files are in the page cache
                t0 = time.perf_counter()
                problems = M.verify(ck, m, w, progress=False)
                secs.append(time.perf_counter() - t0)
                assert not problems, problems[:3]
            dt = sorted(secs)[len(secs) // 2]
            runs.append(
                {
                    "workers": w,
                    "cache": cache,
                    "seconds": [round(x, 3) for x in secs],
                    "MB_per_s": round(nbytes / dt / 1e6),  # of the median run
                }
            )
            print(runs[-1])
    res = {
        "machine": f"{platform.node()} {os.cpu_count()} CPU cores, {platform.machine()}",
        "checkpoint": {"bytes": nbytes, "files": nfiles, "largest_chunk_bytes": biggest, "convert_s": round(convert_s)},
        "hash_MB_per_s_one_core": _hash_rates(),
        "runs": runs,
        "load_average": [round(load0, 1), round(os.getloadavg()[0], 1)],  # the machine may be shared
    }
    print(res["hash_MB_per_s_one_core"])
    os.makedirs("bench/results", exist_ok=True)
    with open("bench/results/check_throughput.json", "w") as f:
        json.dump(res, f, indent=1)
    with open("bench/results/check_throughput.md", "w") as f:
        f.write(_markdown(res))
    if not a.keep:
        shutil.rmtree(a.workdir)


def _markdown(r: dict) -> str:
    c = r["checkpoint"]
    rows = "\n".join(
        f"| {x['workers']} | {x['cache']} | {', '.join(map(str, x['seconds']))} | {x['MB_per_s']} |" for x in r["runs"]
    )
    h = r["hash_MB_per_s_one_core"]
    return (
        "# Checkpoint check throughput (`k3jax-convert --check`)\n\n"
        f"Machine: {r['machine']}. Checkpoint: {c['bytes'] / 1e6:.0f} MB in {c['files']} files (largest chunk "
        f"{c['largest_chunk_bytes'] / 1e6:.0f} MB), converted by the real converter. Produced by "
        "`bench/check_throughput.py`. Warm: the files in the page cache (the hashing rate); cold: each file's "
        "pages dropped first (posix_fadvise DONTNEED), so the disk is read.\n\n"
        "| workers | cache | seconds (each run) | MB/s (median run) |\n|---|---|---|---|\n"
        f"{rows}\n\n"
        f"1-minute load average at the start / end: {r['load_average'][0]} / {r['load_average'][1]} "
        f"(on {os.cpu_count()} cores: other work shared them).\n"
        f"One core, best of 3 over 256 MB in memory: SHA-256 {h['sha256']} MB/s, blake2b {h['blake2b']} MB/s "
        "(the manifest uses SHA-256, truncated to 8 bytes).\n"
    )


if __name__ == "__main__":
    main()
