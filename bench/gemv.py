"""The decode GEMV (pallas_kernels.gemv) against XLA's out-major GEMV on one GPU, CUPTI device time, at one
TP16 / TP8 rank's KDA projection shapes (q/k/v/g + f_a, and o_proj).

  PYTHONPATH=. python3 bench/gemv.py OUT [--batches 1,8,16,32,64] [--sweep] [--name gemv]   # -> OUT/NAME.json

Per case and batch: XLA, and the launch tuning.json picks ("tuned": its `launch` table, `o_proj_launch` for
o); with --sweep also every LAUNCHES entry whose SMEM fits (for retuning: tokens on WGMMA's N or M). Each call
runs SETS distinct weight sets back to back (> the 50 MB L2 together), so the weights stream from HBM as in a
decode step; a row reports the time per set. Inside the KDA sublayer the GEMV runs 2-4 us slower than here:
it follows the decode kernel's state writes (results/gemv_after_writes.json).
"""

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from bench.device_time import device_us, per_kernel_us
from pallas_kernels.gemv import api, kernel, reference
from pallas_kernels.policy import XLA

HBM_PEAK = 4.8e12
SETS = 3
BATCHES = (1, 8, 16, 32, 64)
# (name, D, rows of each weight sharing x, tuning table): one TP16 / TP8 rank's KDA q/k/v/g + f_a, and o_proj
CASES = [
    ("qkvg+f_a tp16", 7168, (3072, 128), "launch"),
    ("qkvg+f_a tp8", 7168, (6144, 128), "launch"),
    ("o tp16", 768, (7168,), "o_proj_launch"),
    ("o tp8", 1536, (7168,), "o_proj_launch"),
    ("mla_in tp16", 7168, (1536, 576, 768), "mla_in_launch"),  # MLA q_a, kv_a, g (tp8: 12 heads of g)
    ("mla_in tp8", 7168, (1536, 576, 1536), "mla_in_launch"),
]
# --sweep: (block_k, split_k, steps, x_stream). SMEM = steps x (a rows x block_k weight tile + a tokens x
# block_k x tile) <= 227 KB. TP16's 50 row blocks x split 2 fill 100 of 132 SMs; splits must divide
# D / block_k (56 at D = 7168, 128). The tuned entries (k128 s2 st6, N to batch 32, M above) and the nearest
# alternatives measured (gemv_small_on_n.json, gemv_tokens_on_n.json, gemv_b64_stream.json).
LAUNCHES = [  # (block_k, split_k, steps, x_stream)
    (128, 2, 6, "N"),
    (256, 2, 4, "N"),
    (128, 1, 6, "N"),
    (128, 2, 6, "M"),
    (64, 2, 12, "M"),
    (128, 4, 4, "M"),
]


def timed(row, key, f, x, sets, want):
    """row[key_us] (per weight set), key_rel_err (worst output's relative RMS vs float64) and key_kernels (one
    set's kernels, median us) for f(x, weights) over every set in one jitted call; a failure is recorded."""
    g = jax.jit(lambda x, sets: [f(x, ws) for ws in sets])
    try:
        got = g(x, sets)[0]
        row[key + "_rel_err"] = max(
            float(np.sqrt(np.mean((np.asarray(a, np.float64) - w) ** 2) / np.mean(w**2)))
            for a, w in zip(got, want, strict=True)
        )
        row[key + "_us"] = device_us(g, x, sets) / SETS
        per_kernel = per_kernel_us(g, x, sets, iters=10)
        row[key + "_kernels"] = [(k, round(t, 2)) for k, t in per_kernel[: len(per_kernel) // SETS]]
    except Exception as e:  # noqa: BLE001
        row[key + "_us"] = f"failed: {type(e).__name__}: {e}"[:300]


def launch_key(block_k, split_k, steps, x_stream):
    return f"pallas k{block_k} s{split_k} st{steps}" + {"M": " xs", "N": " xsN"}[x_stream]


def main(out_dir, batches=BATCHES, sweep=False, name="gemv"):
    dev = jax.devices()[0]
    results = dict(
        device=f"{dev.device_kind} (cc {dev.compute_capability})",
        jax=jax.__version__,
        sets=SETS,
        measure="CUPTI device time per weight set, median of 30 calls",
        tuning=XLA.table("gemv")["sm90"],
        rows=[],
    )
    r = np.random.default_rng(0)
    for case, D, rows, table in CASES:
        for B in batches:
            x = jnp.asarray(r.standard_normal((B, D)), jnp.bfloat16)
            sets = [
                tuple(jnp.asarray(r.standard_normal((n, D)) * D**-0.5, jnp.bfloat16) for n in rows) for _ in range(SETS)
            ]
            want = [np.asarray(x, np.float64) @ np.asarray(w, np.float64).T for w in sets[0]]
            nbytes = sum(w.nbytes for w in sets[0]) + x.nbytes
            row = dict(case=case, B=B, D=D, rows=rows, MB=nbytes / 1e6, floor_us=nbytes / HBM_PEAK * 1e6)
            timed(row, "xla", reference.gemv, x, sets, want)
            launches = {}
            try:
                tuned = api.pick_launch(B, D, table)
                row["tuned"] = launch_key(**tuned)
                launches[row["tuned"]] = tuned
            except NotImplementedError as e:  # no entry for this batch: the api runs XLA
                row["tuned"] = f"none: {e}"
            for bk, sk, st, stream in LAUNCHES if sweep else ():
                if (
                    D % (bk * sk) == 0
                    and D // (bk * sk) >= 2  # kernel.check_supported
                    and kernel.smem_bytes(B, D, bk, sk, st, stream) <= kernel.SMEM_BYTES
                ):
                    launch = dict(block_k=bk, split_k=sk, steps=st, x_stream=stream)
                    launches.setdefault(launch_key(**launch), launch)
            for key, launch in launches.items():
                timed(row, key, lambda x, ws, launch=launch: kernel.gemv(x, ws, **launch), x, sets, want)
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            pathlib.Path(out_dir, f"{name}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", nargs="?", default=".")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--sweep", action="store_true", help="also every LAUNCHES entry that fits")
    ap.add_argument("--name", default="gemv", help="the result file's name")
    a = ap.parse_args()
    main(a.out_dir, tuple(int(b) for b in a.batches.split(",")), a.sweep, a.name)
