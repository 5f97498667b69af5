"""The layer-boundary kernel alone on one GPU (no exchange: TP1 and the rank slice's stub), each AttnRes form
against XLA's boundary, K3's hidden width, CUPTI device time of one call (bench/device_time.py).

  python bench/mix_norm.py --out DIR [--batches 1,64] [--blocks 1,4,8]

A boundary reads the prefix, the N stored blocks and x (B x 7168 bf16 each) and writes two rows: at batch 1 that
is ~0.1 MB, a ~0.02 us floor at 4.8 TB/s; the kernel is latency-bound, so the rows compare launches, not bytes.
Writes DIR/mix_norm.json and DIR/mix_norm.md.
"""

import argparse
import json
import os
import sys

import jax
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.device_time import device_us, kernel_names  # noqa: E402
from pallas_kernels.collectives import api, mix_norm  # noqa: E402
from pallas_kernels.policy import SPECIALIZED, XLA, Tuning  # noqa: E402

BF16 = ml_dtypes.bfloat16
D = 7168


def boundary(attnres):
    """The jitted boundary: XLA's (attnres None) or the kernel with that AttnRes form."""
    if attnres is None:
        policy = XLA
    else:
        table = dict(XLA.table("collectives"), mix_norm_single_device=True, mix_norm_attnres=attnres)
        policy = SPECIALIZED.replace(tuning=Tuning.from_files(collectives=table))
    return jax.jit(lambda x, p, blocks, *w: api.all_reduce_mix_norm(x, p, blocks, *w, 1e-5, None, policy=policy))


def operands(rng, b, n_blocks):
    x, p = (rng.standard_normal((b, D)).astype(BF16) for _ in range(2))
    blocks = tuple(rng.standard_normal((b, D)).astype(BF16) for _ in range(n_blocks))
    res_norm, norm = ((1 + 0.3 * rng.standard_normal(D)).astype(BF16) for _ in range(2))
    res_proj = (rng.standard_normal(D) * 2 / np.sqrt(D)).astype(BF16)
    return [jax.device_put(a) for a in (x, p, blocks, res_norm, res_proj, norm)]


def write_md(results, path):
    forms = ["xla", *mix_norm.ATTNRES]
    lines = [
        f"# The layer boundary on one GPU ({results['device']}, jax {results['jax']})",
        "",
        "CUPTI device time of one call, us (median of 30); d = 7168 bf16, with a prefix; `bench/mix_norm.py`.",
        "",
        "| B | blocks | " + " | ".join(forms) + " | XLA kernels |",
        "|---|---|" + "---|" * len(forms) + "---|",
    ]
    for r in results["rows"]:
        cells = " | ".join(f"{r[f + '_us']:.2f}" for f in forms)
        lines.append(f"| {r['B']} | {r['blocks']} | {cells} | {r['xla_kernels']} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--blocks", default="1,4,8")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(0)
    results = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=[])
    for b in map(int, args.batches.split(",")):
        for n_blocks in map(int, args.blocks.split(",")):
            ops = operands(rng, b, n_blocks)
            row = dict(B=b, blocks=n_blocks, xla_kernels=len(kernel_names(boundary(None), *ops)))
            for form in (None, *mix_norm.ATTNRES):
                row[f"{form or 'xla'}_us"] = device_us(boundary(form), *ops)
            results["rows"].append(row)
            print(row, flush=True)
            with open(os.path.join(args.out, "mix_norm.json"), "w") as f:
                json.dump(results, f, indent=1)
            write_md(results, os.path.join(args.out, "mix_norm.md"))


if __name__ == "__main__":
    main()
