"""The decode GEMV (pallas_kernels.gemv) against XLA's out-major GEMV on one GPU, CUPTI device time.

Run on the device machine from the repo root: PYTHONPATH=. python3 bench/gemv.py OUT
(`--b64 OUT`: batch 64, the launches whose x slabs fit SMEM, and the api's glue -> OUT/gemv_b64.json;
`--b64-stream OUT`: batch 64 with x streamed beside the weights against the best resident launches ->
OUT/gemv_b64_stream.json; `--mid OUT`: the streamed launches alone at batch 16, 32 and 64, x unpadded (the
TMA's zero fill past B) -> OUT/gemv_mid_batch.json; `--after-writes OUT`: the tuned GEMV right after a kernel
that writes 0-25 MB -> OUT/gemv_after_writes.json)
Each call runs SETS distinct weight sets back to back (> the 50 MB L2 together), so the weights stream from
HBM as in a decode step; a row reports the time per set. Writes OUT/gemv.json.
"""

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.device_time import device_us, per_kernel_us
from pallas_kernels.gemv import kernel, reference

HBM_PEAK = 4.8e12
SETS = 3
# (name, D, rows of each weight sharing x): one TP16 / TP8 rank's KDA q/k/v/g + f_a, and o_proj
CASES = [("qkvg+f_a tp16", 7168, (3072, 128)), ("qkvg+f_a tp8", 7168, (6144, 128)),
         ("o tp16", 768, (7168,)), ("o tp8", 1536, (7168,))]
# block_k, split_k, steps; SMEM = x slabs (D / split_k x 8 tokens) + steps weight tiles (64 x block_k), <= 227 KB.
# The tuned k256 s2 st4 holds 185 KB (one CTA per SM) and TP16's 50 row blocks x 2 fill 100 of 132 SMs; the
# split-7/8 rows (~64 KB, 3 CTAs per SM, 350-400 CTAs in one wave) ask whether filling every SM wins back
# more than the shorter pipelines lose. Splits must divide D / block_k (56 at D = 7168, 128).
CONFIGS = [(256, 2, 4), (128, 4, 4), (256, 1, 3), (128, 2, 6), (256, 4, 3), (128, 1, 6), (128, 7, 3), (128, 7, 4),
           (128, 8, 3)]


def timed(row, key, f, x, sets, want):
    """row[key_us] (per weight set), key_rel_err (worst output's relative RMS vs float64) and key_kernels (one
    set's kernels, median us) for f(x, weights) over every set in one jitted call; a failure is recorded."""
    g = jax.jit(lambda x, sets: [f(x, ws) for ws in sets])
    try:
        got = g(x, sets)[0]
        row[key + "_rel_err"] = max(float(np.sqrt(np.mean((np.asarray(a, np.float64) - w) ** 2) / np.mean(w ** 2)))
                                    for a, w in zip(got, want, strict=True))
        row[key + "_us"] = device_us(g, x, sets) / SETS
        per_kernel = per_kernel_us(g, x, sets, iters=10)
        row[key + "_kernels"] = [(k, round(t, 2)) for k, t in per_kernel[:len(per_kernel) // SETS]]
    except Exception as e:  # noqa: BLE001
        row[key + "_us"] = f"failed: {type(e).__name__}: {e}"[:300]


# Batch 64: x's slabs are 8x larger (D / split_k x 64 tokens x 2 bytes), so only long splits fit SMEM with
# the weight stages (block_k, split_k, steps, rows). 64-row blocks read as many bytes of x from L2 as of
# weights from HBM (19 us at best, gemv_b64.json); 128-row blocks halve that: 175 CTAs of 195 KB at k64 s7,
# 350 of 193 KB at k128 s14 (the eleventh session's queue for the twelfth).
B64_CONFIGS = [(128, 7, 4, 64), (128, 14, 3, 64), (64, 7, 4, 128), (64, 7, 6, 128), (128, 14, 4, 128),
               (128, 7, 2, 128)]


# x streamed beside the weights (block_k, split_k, steps, rows, x_stream): no resident slabs, so short splits fit
# at batch 64. TP16's 50 row blocks: split 2 -> 100 CTAs of one per SM (192 KB); split 4 -> 200 CTAs of 96 KB,
# two per SM, all resident; split 7 -> 350 of 64 KB, three per SM, one wave. The first row is the resident
# launch that measured best (gemv_b64.json). The thirteenth session's first call measured all of these
# (gemv_b64_stream_nt.json, partials [S, N, T]): split 2, 6 stages of 128 columns best; its second the four
# kept here with the tokens on M (token-major partials).
B64_STREAM_CONFIGS = [(128, 7, 4, 64, False), (128, 2, 6, 64, "M"), (64, 2, 12, 64, "M"), (128, 4, 4, 128, "M")]


def main(out_dir, batches=(1, 8), configs=CONFIGS, cases=CASES, name="gemv"):
    dev = jax.devices()[0]
    results = dict(device=f"{dev.device_kind} (cc {dev.compute_capability})", jax=jax.__version__, sets=SETS,
                   measure="CUPTI device time per weight set, median of 30 calls", rows=[])
    r = np.random.default_rng(0)
    for case, D, rows in cases:
        for B in batches:
            x = jnp.asarray(r.standard_normal((B, D)), jnp.bfloat16)
            sets = [tuple(jnp.asarray(r.standard_normal((n, D)) * D ** -0.5, jnp.bfloat16) for n in rows)
                    for _ in range(SETS)]
            want = [np.asarray(x, np.float64) @ np.asarray(w, np.float64).T for w in sets[0]]
            nbytes = sum(w.nbytes for w in sets[0]) + x.nbytes
            row = dict(case=case, B=B, D=D, rows=rows, MB=nbytes / 1e6, floor_us=nbytes / HBM_PEAK * 1e6)
            timed(row, "xla", reference.gemv, x, sets, want)
            for bk, sk, st, *more in configs:
                rows_ = more[0] if more else kernel.ROWS
                stream = len(more) > 1 and more[1]
                if (D % (bk * sk) == 0 and D // (bk * sk) >= 2  # kernel.check_supported
                        and kernel.smem_bytes(B, D, bk, sk, st, rows_, stream) <= kernel.SMEM_BYTES):
                    key = f"pallas k{bk} s{sk} st{st}" + (f" r{rows_}" if more else "") + {
                        False: "", True: " xs", "M": " xs", "N": " xsN"}[stream]
                    timed(row, key, lambda x, ws, bk=bk, sk=sk, st=st, r=rows_, xs=stream: kernel.gemv(
                        x, ws, block_k=bk, split_k=sk, steps=st, rows=r, x_stream=xs), x, sets, want)
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            pathlib.Path(out_dir, f"{name}.json").write_text(json.dumps(results, indent=1))


def main_after_writes(out_dir, mbs=(0, 6.3, 12.6, 25.2), batches=(16, 64)):
    """The tuned GEMV (one TP16 rank's q/k/v/g + f_a) right after an XLA kernel that writes W MB (s * c, the way
    a decode step's KDA kernel writes its state before the next layer's GEMV): if the dirty L2 lines drain to
    HBM while the GEMV streams its weights, the GEMV's kernel time grows by about W / HBM bandwidth. W = 6.3 /
    25.2 MB is the TP16 state at B = 16 / 64. Per weight set i: s_i * c, then the GEMV of x + 0 * (s_i * c)[0]
    (the dependency that orders them). Writes OUT/gemv_after_writes.json."""
    from pallas_kernels.gemv import api
    case, D, rows = CASES[0]
    dev = jax.devices()[0]
    results = dict(device=f"{dev.device_kind} (cc {dev.compute_capability})", jax=jax.__version__, sets=SETS,
                   measure="CUPTI, median of 20 calls; the GEMV's kernel time averaged over the sets", rows=[])
    r = np.random.default_rng(0)
    sets = [tuple(jnp.asarray(r.standard_normal((n, D)) * D ** -0.5, jnp.bfloat16) for n in rows) for _ in range(SETS)]
    for B in batches:
        x = jnp.asarray(r.standard_normal((B, D)), jnp.bfloat16)
        launch = api.pick_launch(B, D)
        for mb in mbs:
            n = max(256, int(mb * 1e6 / 4) // 256 * 256)
            states = [jnp.asarray(r.standard_normal(n), jnp.float32) for _ in range(SETS)]

            def f(x, sets, states, launch=launch):
                outs = []
                for ws, s in zip(sets, states, strict=True):
                    s2 = s * 1.0001
                    outs.append((s2, kernel.gemv(x + (0 * s2[0]).astype(x.dtype), ws, **launch)))
                return outs
            g = jax.jit(f)
            per_kernel = per_kernel_us(g, x, sets, states)
            gemv_us = [t for name, t in per_kernel if "mosaic" in name]
            row = dict(case=case, B=B, launch=launch, written_MB=n * 4 / 1e6, gemv_us=sum(gemv_us) / len(gemv_us),
                       kernels=[(k, round(t, 2)) for k, t in per_kernel])
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            pathlib.Path(out_dir, "gemv_after_writes.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--mid"]:  # q/k/v/g + f_a (split 2) and o_proj (split 1, the output written directly)
        main(sys.argv[2] if len(sys.argv) > 2 else ".", batches=(16, 32, 64),
             configs=[(128, 2, 6, 64, "M"), (128, 1, 6, 64, "M")], cases=[CASES[0], CASES[2]],
             name="gemv_mid_batch")
    elif sys.argv[1:2] == ["--tokens-on-n"]:  # x streamed with the tokens on WGMMA's M (64-row tile) or N
        main(sys.argv[2] if len(sys.argv) > 2 else ".", batches=(12, 16, 32, 48),
             configs=[(128, s, 6, 64, on) for s in (2, 1) for on in ("M", "N")], cases=[CASES[0], CASES[2]],
             name="gemv_tokens_on_n")
    elif sys.argv[1:2] == ["--after-writes"]:
        main_after_writes(sys.argv[2] if len(sys.argv) > 2 else ".")
    elif sys.argv[1:2] == ["--small-on-n"]:  # batch <= 8: x resident (tuned) or streamed with the tokens on N
        main(sys.argv[2] if len(sys.argv) > 2 else ".", batches=(1, 8),
             configs=[(256, 2, 4), (128, 2, 6, 64, "N"), (256, 2, 4, 64, "N"), (128, 2, 8, 64, "N"),
                      (128, 1, 6, 64, "N")], cases=CASES, name="gemv_small_on_n")
    elif sys.argv[1:2] == ["--b64-stream"]:
        main(sys.argv[2] if len(sys.argv) > 2 else ".", batches=(64,), configs=B64_STREAM_CONFIGS, cases=CASES[:2],
             name="gemv_b64_stream")
    elif sys.argv[1:2] == ["--b64"]:
        main(sys.argv[2] if len(sys.argv) > 2 else ".", batches=(64,), configs=B64_CONFIGS, cases=CASES[:2],
             name="gemv_b64")
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else ".")
