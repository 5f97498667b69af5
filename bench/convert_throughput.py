"""Conversion throughput on a generated multi-GB K3-format checkpoint, projected to the 1.4 TB release.

    PYTHONPATH=. python bench/convert_throughput.py [--workdir /tmp/k3bench] [--workers 2] [--keep]

The fake checkpoint has the release's structure and tensor names (93 layers, the MLA/KDA pattern, 92 MoE
layers of MXFP4 experts, full vocabulary) at reduced widths (`convert.fake_hf.K3_NARROW`), so both the
per-byte cost (large tensors) and the per-tensor cost (~35k expert tensors) are exercised. The projection
uses the measured source MB/s and tensors/s: time = bytes / (bytes/s) is what dominates for the release,
whose mean tensor is 2.9 MB (here: much smaller, so this run is the pessimistic side of per-tensor overhead).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time

from convert.core import Options, convert
from convert.fake_hf import fake_config, write_fake_hf

RELEASE_BYTES = 1.42e12  # docs/model.md §7.1
RELEASE_TENSORS = 497_220


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/k3bench")
    ap.add_argument("--workers", type=int, nargs="+", default=[2])
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    hf, out = os.path.join(a.workdir, "hf"), os.path.join(a.workdir, "ck")
    shutil.rmtree(a.workdir, ignore_errors=True)
    cfg = fake_config("k3-narrow")
    t0 = time.perf_counter()
    info = write_fake_hf(hf, cfg, seed=0, shards=8, vision=True, progress=True)
    gen_s = time.perf_counter() - t0
    runs = []
    for w in a.workers:
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
        t0 = time.perf_counter()
        meta = convert(hf, out, Options(workers=w, progress=True))
        dt = time.perf_counter() - t0
        n = meta["source"]["tensors_read"]
        runs.append(
            {
                "workers": w,
                "seconds": round(dt, 2),
                "source_MB_per_s": round(info["bytes"] / dt / 1e6, 1),
                "tensors_per_s": round(n / dt),
                "projected_release_hours": round(RELEASE_BYTES / (info["bytes"] / dt) / 3600, 2),
            }
        )
        print(runs[-1])
    best = max(runs, key=lambda r: r["source_MB_per_s"])
    res = {
        "machine": f"{platform.node()} {os.cpu_count()} CPU cores, {platform.machine()}",
        "checkpoint": {
            "config": "k3-narrow",
            "bytes": info["bytes"],
            "tensors": info["tensors"],
            "files": len(info["files"]),
            "generate_seconds": round(gen_s, 1),
        },
        "runs": runs,
        "release_projection": {
            "bytes": RELEASE_BYTES,
            "tensors": RELEASE_TENSORS,
            "hours_at_measured_MB_per_s": best["projected_release_hours"],
            "per_tensor_overhead_bound_hours": round(RELEASE_TENSORS / best["tensors_per_s"] / 3600, 2),
        },
    }
    os.makedirs("bench/results", exist_ok=True)
    with open("bench/results/convert_throughput.json", "w") as f:
        json.dump(res, f, indent=1)
    with open("bench/results/convert_throughput.md", "w") as f:
        f.write(_markdown(res))
    print(json.dumps(res, indent=1))
    if not a.keep:
        shutil.rmtree(a.workdir, ignore_errors=True)


def _markdown(r) -> str:
    c = r["checkpoint"]
    lines = [
        "# Conversion throughput (k3jax-convert)",
        "",
        f"Machine: {r['machine']}. Fake K3-format checkpoint `k3-narrow` (real names and structure, reduced "
        f"widths): {c['bytes'] / 1e9:.2f} GB, {c['tensors']} tensors in {c['files']} shards "
        f"(generated in {c['generate_seconds']} s). Produced by `bench/convert_throughput.py`.",
        "",
        "| workers | seconds | source MB/s | tensors/s | projected 1.42 TB release (h) |",
        "|---|---|---|---|---|",
    ]
    for x in r["runs"]:
        lines.append(
            f"| {x['workers']} | {x['seconds']} | {x['source_MB_per_s']} | {x['tensors_per_s']} | "
            f"{x['projected_release_hours']} |"
        )
    p = r["release_projection"]
    lines += [
        "",
        f"Projection: 1.42 TB at the measured rate = **{p['hours_at_measured_MB_per_s']} h** on this "
        f"2-core machine; the per-tensor overhead alone for 497,220 tensors would be "
        f"{p['per_tensor_overhead_bound_hours']} h at the measured tensors/s (an upper bound: this checkpoint's "
        "tensors are far smaller than the release's 2.9 MB mean, so its MB/s already includes proportionally "
        "more per-tensor cost). A machine with more cores and NVMe scales with --workers.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
