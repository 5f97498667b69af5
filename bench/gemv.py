"""The decode GEMV (pallas_kernels.gemv) against XLA's out-major GEMV on one GPU, CUPTI device time, at one
TP16 / TP8 rank's KDA projection shapes (q/k/v/g + f_a, and o_proj), MoE in-projections (the router's fp32
logits, latent_down and the shared experts' gate and up in one launch: layers/moe.py in_projections) and MoE
finish (latent_up + shared_down summed into one [B, 7168] output, the pairs' GEMV kernel.gemv_sum: moe.finish).

  PYTHONPATH=. python3 bench/gemv.py OUT [--batches 1,8,16,32,64] [--sweep] [--cases moe_in] [--name gemv]
      [--deadline-s S]   # -> OUT/NAME.json

Per case and batch: XLA (the reference, with the case's out_dtypes), and the launch tuning.json picks ("tuned":
the case's table); with --sweep also every entry of the case's candidate list that the kernel takes (LAUNCHES
for the KDA cases, for retuning; MOE_LAUNCHES for the MoE's, whose table moe_in_launch is empty until they are
measured: its rows say "tuned: none" and the sweep's rows are the candidates; MOE_OUT_LAUNCHES for the finish,
once per kernel they make: at TP16 block_k 192 and 256 make one, 2 steps of 128 + 192 columns). Each call runs n
distinct weight sets back to back, >= SETS and together >= COLD_BYTES (past the 50 MB L2), so the weights stream
from HBM as in a decode step; a row reports the time per set. Inside the KDA sublayer the GEMV runs 2-4 us slower
than here: it follows the decode kernel's state writes (results/gemv_after_writes.json). Rows not started by the
deadline are skipped (the JSON is rewritten after every row).
"""

import argparse
import json
import math
import pathlib
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from bench.device_time import device_us, per_kernel_us
from bench.rank_slice import local_shape
from k3jax import params
from k3jax.config import K3Config
from pallas_kernels.gemv import api, kernel, reference
from pallas_kernels.policy import XLA

HBM_PEAK = 4.8e12
SETS = 3
COLD_BYTES = 100e6  # the weight sets of one call together: twice the H200's 50 MB L2
BATCHES = (1, 8, 16, 32, 64)
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
# The MoE in-projections' candidates (tuning.json's _doc names them): few row blocks (TP16 1 + 4 + 6 + 6 = 17,
# TP8 2 + 7 + 12 + 12 = 33), so the splits fill the SMs (TP16 x7 = 119 CTAs, TP8 x4 = 132); split 1 writes the
# outputs itself (no glue kernel: each partial-summed output is an XLA fusion of its own) with 17 / 33 CTAs.
MOE_LAUNCHES = [
    (128, 1, 6, "N"),
    (128, 2, 6, "N"),
    (128, 4, 6, "N"),
    (128, 7, 6, "N"),
    (128, 8, 6, "N"),
    (128, 1, 6, "M"),
    (128, 2, 6, "M"),
    (128, 4, 6, "M"),
]
# The MoE finish's candidates (tuning.json's moe_out_launch _doc): 112 row blocks of N = 7168, split 1 (the
# kernel rounds each pair's product itself), block_k the widest pair's block (kernel.pair_blocks: TP16 128 -> 3
# lockstep steps of 96 + 128 columns, 192 / 256 -> 2 of 128 + 192; TP8 128 -> 6 of 80 + 128, 192 -> 4 of 128 +
# 192, 256 -> 3 of 192 + 256), every stage in flight or 2; tokens on N or M (o_proj's analogue).
MOE_OUT_LAUNCHES = [
    (192, 1, 4, "N"),
    (128, 1, 6, "N"),
    (256, 1, 3, "N"),
    (192, 1, 2, "N"),
    (192, 1, 2, "M"),
    (128, 1, 3, "M"),
    (256, 1, 2, "M"),
]
MOE_OUT = ("latent_up", "shared_down")  # finish's weights [D, K_j], in its order
MOE_IN = ("router", "latent_down", "shared_gate", "shared_up")  # in_projections' weights, in its order
MOE_DTYPES = (jnp.float32,) + (jnp.bfloat16,) * 3  # the router's logits unrounded


class Case(NamedTuple):
    name: str
    D: int
    rows: tuple  # each weight's rows, all sharing x
    table: str  # tuning.json's launch list for it
    out_dtypes: tuple | None = None  # None: x's dtype for every output
    launches: tuple = tuple(LAUNCHES)  # what --sweep tries
    ks: tuple = ()  # a pairs' sum (kernel.gemv_sum): each pair's K, x_j [B, K_j] and w_j [D, K_j]; rows = (D,)


def moe_in_rows(tp):
    """One rank's rows of the MoE in-projections: the tensor table's shapes split as the sharding rules split
    them (TP16: 56 / 224 / 384 / 384, TP8: 112 / 448 / 768 / 768; the first two not whole 64-row blocks)."""
    specs = {s.path[-1]: s for s in params.tensor_table(K3Config()) if s.path[-1] in MOE_IN}
    return tuple(local_shape(specs[n], tp)[0] for n in MOE_IN)


def moe_out_ks(tp):
    """One rank's K of the MoE finish's weights (latent_up [D, Dl], shared_down [D, S], split by their inputs:
    TP16 224 / 384, TP8 448 / 768)."""
    specs = {s.path[-1]: s for s in params.tensor_table(K3Config()) if s.path[-1] in MOE_OUT}
    return tuple(local_shape(specs[n], tp)[1] for n in MOE_OUT)


# one TP16 / TP8 rank's KDA q/k/v/g + f_a, o_proj, MoE in-projections and MoE finish
CASES = [
    Case("qkvg+f_a tp16", 7168, (3072, 128), "launch"),
    Case("qkvg+f_a tp8", 7168, (6144, 128), "launch"),
    Case("o tp16", 768, (7168,), "o_proj_launch"),
    Case("o tp8", 1536, (7168,), "o_proj_launch"),
    Case("moe_in tp16", 7168, moe_in_rows(16), "moe_in_launch", MOE_DTYPES, tuple(MOE_LAUNCHES)),
    Case("moe_in tp8", 7168, moe_in_rows(8), "moe_in_launch", MOE_DTYPES, tuple(MOE_LAUNCHES)),
    Case("mla_in tp16", 7168, (1536, 576, 768), "mla_in_launch"),  # MLA q_a, kv_a, g (tp8: 12 heads of g)
    Case("mla_in tp8", 7168, (1536, 576, 1536), "mla_in_launch"),
    Case("moe_out tp16", 7168, (7168,), "moe_out_launch", launches=tuple(MOE_OUT_LAUNCHES), ks=moe_out_ks(16)),
    Case("moe_out tp8", 7168, (7168,), "moe_out_launch", launches=tuple(MOE_OUT_LAUNCHES), ks=moe_out_ks(8)),
]


def weight_bytes(case: Case) -> int:
    """One weight set's bytes: the case's weights [rows, D], or a pairs' sum's [D, K_j]."""
    return (case.D * sum(case.ks) if case.ks else sum(case.rows) * case.D) * 2


def n_sets(case: Case, cold_bytes=COLD_BYTES) -> int:
    """Weight sets per call: SETS, or more where they would not outgrow the L2 together (o, the MoE's)."""
    return max(SETS, math.ceil(cold_bytes / weight_bytes(case)))


def candidates(case: Case, B, sweep=False, policy=XLA) -> tuple[dict, str]:
    """{row key: launch} to time beside XLA, and what the table picks ("tuned": its key, or why none): the
    tuned launch, and with sweep every case.launches entry that kernel.check_supported (a pairs' sum:
    check_sum_supported) takes for these weights; a pairs' sum's launches that make the same kernel once."""
    if case.ks:
        x = tuple(jax.ShapeDtypeStruct((B, K), jnp.bfloat16) for K in case.ks)
        ws = tuple(jax.ShapeDtypeStruct((case.D, K), jnp.bfloat16) for K in case.ks)
        check, D = kernel.check_sum_supported, max(case.ks)
    else:
        x = jax.ShapeDtypeStruct((B, case.D), jnp.bfloat16)
        ws = tuple(jax.ShapeDtypeStruct((n, case.D), jnp.bfloat16) for n in case.rows)
        check, D = kernel.check_supported, case.D

    def same(launch):  # what the kernel runs: a pairs' sum's steps, blocks and stages, else the launch itself
        if not case.ks:
            return launch_key(**launch)
        n, bks, _ = kernel.pair_blocks(case.ks, launch["block_k"])
        return (n, bks, min(launch["steps"], n), launch["x_stream"])

    launches, made = {}, set()
    try:
        tuned = api.pick_launch(B, D, case.table, policy)
        check(x, ws, **tuned)
        launches[launch_key(**tuned)] = tuned
        picked = launch_key(**tuned)
        made.add(same(tuned))
    except NotImplementedError as e:  # no entry for this batch (moe_in_launch: none yet): the api runs XLA
        picked = f"none: {e}"
    for bk, sk, st, stream in case.launches if sweep else ():
        launch = dict(block_k=bk, split_k=sk, steps=st, x_stream=stream)
        try:
            check(x, ws, **launch)
        except NotImplementedError:
            continue
        if same(launch) not in made:
            launches.setdefault(launch_key(**launch), launch)
            made.add(same(launch))
    return launches, picked


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
        row[key + "_us"] = device_us(g, x, sets) / len(sets)
        per_kernel = per_kernel_us(g, x, sets, iters=10)
        row[key + "_kernels"] = [(k, round(t, 2)) for k, t in per_kernel[: len(per_kernel) // len(sets)]]
    except Exception as e:  # noqa: BLE001
        row[key + "_us"] = f"failed: {type(e).__name__}: {e}"[:300]


def launch_key(block_k, split_k, steps, x_stream):
    return f"pallas k{block_k} s{split_k} st{steps}" + {"M": " xs", "N": " xsN"}[x_stream]


def main(
    out_dir,
    batches=BATCHES,
    sweep=False,
    name="gemv",
    cases=CASES,
    deadline_s=math.inf,
    interpret=None,
    cold_bytes=COLD_BYTES,
):
    """interpret (the kernel's interpret params) and cold_bytes 0 (SETS sets): a CPU check of the plumbing at
    small cases."""
    t0 = time.time()
    dev = jax.devices()[0]
    results = dict(
        device=f"{dev.device_kind} (cc {getattr(dev, 'compute_capability', None)})",
        jax=jax.__version__,
        sets=SETS,
        cold_bytes=cold_bytes,
        measure="CUPTI device time per weight set, median of 30 calls",
        tuning=XLA.table("gemv")["sm90"],
        rows=[],
        skipped=[],
    )
    r = np.random.default_rng(0)
    for B in batches:  # batch-major: a deadline cuts the last batches of every case, not the last cases
        for case in cases:
            if time.time() - t0 > deadline_s:
                results["skipped"].append(dict(case=case.name, B=B))
                continue
            D, dtypes = case.D, case.out_dtypes
            if case.ks:  # a pairs' sum: x_j [B, K_j], w_j [D, K_j], one [B, D] output
                x = tuple(jnp.asarray(r.standard_normal((B, K)), jnp.bfloat16) for K in case.ks)
                sets = [
                    tuple(jnp.asarray(r.standard_normal((D, K)) * K**-0.5, jnp.bfloat16) for K in case.ks)
                    for _ in range(n_sets(case, cold_bytes))
                ]
                want = [
                    sum(
                        np.asarray(a, np.float64) @ np.asarray(w, np.float64).T for a, w in zip(x, sets[0], strict=True)
                    )
                ]
                x_bytes = sum(a.nbytes for a in x)
            else:
                x = jnp.asarray(r.standard_normal((B, D)), jnp.bfloat16)
                sets = [
                    tuple(jnp.asarray(r.standard_normal((n, D)) * D**-0.5, jnp.bfloat16) for n in case.rows)
                    for _ in range(n_sets(case, cold_bytes))
                ]
                want = [np.asarray(x, np.float64) @ np.asarray(w, np.float64).T for w in sets[0]]
                x_bytes = x.nbytes
            nbytes = sum(w.nbytes for w in sets[0]) + x_bytes
            row = dict(
                case=case.name,
                B=B,
                D=D,
                rows=case.rows,
                ks=case.ks,
                out_dtypes=[str(jnp.dtype(d)) for d in dtypes or (jnp.bfloat16,) * len(case.rows)],
                sets=len(sets),
                MB=nbytes / 1e6,
                floor_us=nbytes / HBM_PEAK * 1e6,
            )
            if case.ks:
                timed(row, "xla", lambda x, ws: (reference.gemv_sum(x, ws),), x, sets, want)
            else:
                timed(row, "xla", lambda x, ws, dtypes=dtypes: reference.gemv(x, ws, dtypes), x, sets, want)
            launches, row["tuned"] = candidates(case, B, sweep)
            for key, launch in launches.items():

                def f(x, ws, launch=launch, dtypes=dtypes, ks=case.ks):
                    if ks:
                        return (kernel.gemv_sum(x, ws, interpret=interpret, **launch),)
                    return kernel.gemv(x, ws, out_dtypes=dtypes, interpret=interpret, **launch)

                timed(row, key, f, x, sets, want)
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            pathlib.Path(out_dir, f"{name}.json").write_text(json.dumps(results, indent=1))
    if results["skipped"]:
        print(f"deadline: skipped {results['skipped']}", flush=True)
        pathlib.Path(out_dir, f"{name}.json").write_text(json.dumps(results, indent=1))
    return results


def pick_cases(spec):
    """--cases: comma-separated prefixes of case names ("moe_in", "moe_out", "qkvg+f_a tp16"); empty: all."""
    chosen = [c for c in CASES if not spec or any(c.name.startswith(p.strip()) for p in spec.split(","))]
    if not chosen:
        raise SystemExit(f"--cases {spec!r}: none of {[c.name for c in CASES]}")
    return chosen


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", nargs="?", default=".")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--sweep", action="store_true", help="also every candidate launch of the case that fits")
    ap.add_argument("--cases", default="", help="comma-separated prefixes of case names (default: all)")
    ap.add_argument("--name", default="gemv", help="the result file's name")
    ap.add_argument("--deadline-s", type=float, default=math.inf, help="start no row after this many seconds")
    a = ap.parse_args()
    main(a.out_dir, tuple(int(b) for b in a.batches.split(",")), a.sweep, a.name, pick_cases(a.cases), a.deadline_s)
