"""The decode GEMV (pallas_kernels.gemv) against XLA's out-major GEMV on one GPU, CUPTI device time.

Run on the device machine from the repo root: PYTHONPATH=. python3 bench/gemv.py OUT (batch 1 and 8, the
launch shapes of CONFIGS -> OUT/gemv.json)
(`--b64-stream OUT`: batch 64, the tokens on M and N -> OUT/gemv_b64_stream.json; `--mid OUT`: on M alone at
batch 16, 32 and 64 -> OUT/gemv_mid_batch.json; `--tokens-on-n OUT`: M against N at batch 12-48 ->
OUT/gemv_tokens_on_n.json; `--small-on-n OUT`: N launches at batch 1 and 8 -> OUT/gemv_small_on_n.json;
`--after-writes OUT`: the tuned GEMV right after a kernel that writes 0-25 MB -> OUT/gemv_after_writes.json)
Until the fourteenth session the kernel could also hold x resident in SMEM; the results of its launches
(gemv.json, gemv_b64.json, the first rows of gemv_b64_stream.json and gemv_small_on_n.json) were taken with
commit 8d122c6 or earlier.
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
CASES = [
    ("qkvg+f_a tp16", 7168, (3072, 128)),
    ("qkvg+f_a tp8", 7168, (6144, 128)),
    ("o tp16", 768, (7168,)),
    ("o tp8", 1536, (7168,)),
]
# (block_k, split_k, steps, rows, x_stream): SMEM = steps x (a rows x block_k weight tile + a tokens x block_k x
# tile) <= 227 KB. TP16's 50 row blocks x split 2 fill 100 of 132 SMs; splits must divide D / block_k (56 at
# D = 7168, 128).
CONFIGS = [(128, 2, 6, 64, "N"), (256, 2, 4, 64, "N"), (128, 2, 8, 64, "N"), (128, 1, 6, 64, "N"), (128, 4, 4, 64, "N")]


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


# Batch 64 (block_k, split_k, steps, rows, x_stream). TP16's 50 row blocks: split 2 -> 100 CTAs of one per SM
# (192 KB); split 4 -> 200 CTAs of 96 KB, two per SM. The thirteenth session measured these with the tokens on
# M (gemv_b64_stream.json; on N the decode kernel's reads of [S, N, 64] partials cost more than it saves).
B64_STREAM_CONFIGS = [(128, 2, 6, 64, "M"), (64, 2, 12, 64, "M"), (128, 4, 4, 128, "M"), (128, 2, 6, 64, "N")]


def main(out_dir, batches=(1, 8), configs=CONFIGS, cases=CASES, name="gemv"):
    dev = jax.devices()[0]
    results = dict(
        device=f"{dev.device_kind} (cc {dev.compute_capability})",
        jax=jax.__version__,
        sets=SETS,
        measure="CUPTI device time per weight set, median of 30 calls",
        rows=[],
    )
    r = np.random.default_rng(0)
    for case, D, rows in cases:
        for B in batches:
            x = jnp.asarray(r.standard_normal((B, D)), jnp.bfloat16)
            sets = [
                tuple(jnp.asarray(r.standard_normal((n, D)) * D**-0.5, jnp.bfloat16) for n in rows) for _ in range(SETS)
            ]
            want = [np.asarray(x, np.float64) @ np.asarray(w, np.float64).T for w in sets[0]]
            nbytes = sum(w.nbytes for w in sets[0]) + x.nbytes
            row = dict(case=case, B=B, D=D, rows=rows, MB=nbytes / 1e6, floor_us=nbytes / HBM_PEAK * 1e6)
            timed(row, "xla", reference.gemv, x, sets, want)
            for bk, sk, st, rows_, stream in configs:
                if (
                    D % (bk * sk) == 0
                    and D // (bk * sk) >= 2  # kernel.check_supported
                    and kernel.smem_bytes(B, D, bk, sk, st, rows_, stream) <= kernel.SMEM_BYTES
                ):
                    key = f"pallas k{bk} s{sk} st{st} r{rows_}" + {"M": " xs", "N": " xsN"}[stream]
                    timed(
                        row,
                        key,
                        lambda x, ws, bk=bk, sk=sk, st=st, r=rows_, xs=stream: kernel.gemv(
                            x, ws, block_k=bk, split_k=sk, steps=st, rows=r, x_stream=xs
                        ),
                        x,
                        sets,
                        want,
                    )
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
    results = dict(
        device=f"{dev.device_kind} (cc {dev.compute_capability})",
        jax=jax.__version__,
        sets=SETS,
        measure="CUPTI, median of 20 calls; the GEMV's kernel time averaged over the sets",
        rows=[],
    )
    r = np.random.default_rng(0)
    sets = [tuple(jnp.asarray(r.standard_normal((n, D)) * D**-0.5, jnp.bfloat16) for n in rows) for _ in range(SETS)]
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
            row = dict(
                case=case,
                B=B,
                launch=launch,
                written_MB=n * 4 / 1e6,
                gemv_us=sum(gemv_us) / len(gemv_us),
                kernels=[(k, round(t, 2)) for k, t in per_kernel],
            )
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            pathlib.Path(out_dir, "gemv_after_writes.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--mid"]:  # q/k/v/g + f_a (split 2) and o_proj (split 1, the output written directly)
        main(
            sys.argv[2] if len(sys.argv) > 2 else ".",
            batches=(16, 32, 64),
            configs=[(128, 2, 6, 64, "M"), (128, 1, 6, 64, "M")],
            cases=[CASES[0], CASES[2]],
            name="gemv_mid_batch",
        )
    elif sys.argv[1:2] == ["--tokens-on-n"]:  # x streamed with the tokens on WGMMA's M (64-row tile) or N
        main(
            sys.argv[2] if len(sys.argv) > 2 else ".",
            batches=(12, 16, 32, 48),
            configs=[(128, s, 6, 64, on) for s in (2, 1) for on in ("M", "N")],
            cases=[CASES[0], CASES[2]],
            name="gemv_tokens_on_n",
        )
    elif sys.argv[1:2] == ["--after-writes"]:
        main_after_writes(sys.argv[2] if len(sys.argv) > 2 else ".")
    elif sys.argv[1:2] == ["--small-on-n"]:  # batch <= 8 with the tokens on N
        main(
            sys.argv[2] if len(sys.argv) > 2 else ".",
            batches=(1, 8),
            configs=CONFIGS[:4],
            cases=CASES,
            name="gemv_small_on_n",
        )
    elif sys.argv[1:2] == ["--b64-stream"]:
        main(
            sys.argv[2] if len(sys.argv) > 2 else ".",
            batches=(64,),
            configs=B64_STREAM_CONFIGS,
            cases=CASES[:2],
            name="gemv_b64_stream",
        )
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else ".")
