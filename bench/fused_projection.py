"""Row-parallel projection + all-reduce (+ residual) on 2 GPUs: XLA vs the fused Pallas kernel.

  python bench/fused_projection.py --check --out DIR   # real shapes vs float64, ranks identical, stress
  python bench/fused_projection.py --bench --out DIR   # CUPTI device time per call

Variants (each rank: x [B, K], its weight rows w [K, D], residual [B, D]; out = residual + sum_r x_r @ w_r):
  xla_f32      dot (FP32 out) + psum of FP32 partials + add      (reference.proj_all_reduce, the fallback)
  xla_bf16     dot (BF16 out) + psum in BF16 + add               (what the model does with comm.all_reduce)
  dot+ar       dot (BF16 out) + Pallas one_shot_st all-reduce + add
  fused        the fused kernel (fused_projection.py), default tiles; fused@... other tile/stage choices
  dot_only     dot + add, no communication: the floor of the GEMM part (not a valid result)
Device time per call = every kernel a call launches on a rank, summed, steady state over a chain of CHAIN
dependent calls (each with its own x and w, so nothing is hoisted and weights do not sit in L2), as in
bench/collectives.py. Writes DIR/fused_projection.json and DIR/fused_projection.md.
"""

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.collectives import barrier_us, sharded, steady_us, two_gpu_run  # noqa: E402
from pallas_kernels import common  # noqa: E402
from pallas_kernels.collectives import api, reference  # noqa: E402
from pallas_kernels.policy import XLA, DecodePolicy  # noqa: E402

BF16 = ml_dtypes.bfloat16
CHAIN = 8
LS = "latency_specialized"
# this bench measures the (opt-in) fused kernel itself
FUSED = DecodePolicy(LS, fused_projection=True)
POLICIES = {LS: FUSED, "xla": XLA}
# FP32 accumulation error allowance, relative to sum |x||w| over all ranks: any summation order of K * n
# products stays far below it, a missing or stale peer tile is orders of magnitude above it.
ACC_TOL = 2.0**-14


# ------------------------------------------------------------------------------------ correctness
def oracle(x_nBK, w_nKD, res_BD=None):
    """float64 sum over ranks of x_r @ w_r (+ residual) and the error scale sum_r |x_r| @ |w_r| (+ |res|)."""
    x, w = x_nBK.astype(np.float64), w_nKD.astype(np.float64)
    ref = sum(x[r] @ w[r] for r in range(len(x)))  # BLAS, rank by rank
    scale = sum(np.abs(x[r]) @ np.abs(w[r]) for r in range(len(x)))
    if res_BD is not None:
        ref = ref + res_BD.astype(np.float64)
        scale = scale + np.abs(res_BD.astype(np.float64))
    return ref, scale


def proj_bad(y_n, ref, scale, axis=None):
    """Bad where rank 0 is off the float64 result by more than one rounding to y's dtype plus the FP32
    accumulation allowance, or where any rank's bits differ from rank 0's. Reduced with any() over `axis`."""
    y = np.asarray(y_n)
    u = float(jnp.finfo(y.dtype).eps) / 2
    err = np.abs(y[0].astype(np.float64) - ref)
    bad = err > u * np.abs(ref) + 2 * ACC_TOL * scale + 1e-30
    bits = y.view(np.uint16 if y.dtype.itemsize == 2 else np.uint32)
    bad = bad | np.any(bits != bits[:1], axis=0)
    return bad.any(axis=axis)


def max_rel_err(y, ref):
    return float(np.max(np.abs(np.asarray(y, np.float64) - ref) / (np.abs(ref) + 1e-3)))


def run_proj(mesh, x_nBK, w_nKD, res_BD=None, policy=FUSED, **kw):
    """Every rank's result of api.proj_all_reduce on per-rank operands (residual replicated)."""
    n = mesh.size
    if res_BD is None:
        f, put = sharded(mesh, lambda x, w: api.proj_all_reduce(x, w, None, "tp", policy=policy, **kw), 2)
        return np.asarray(f(*put(x_nBK, w_nKD)))
    res_n = np.ascontiguousarray(np.broadcast_to(res_BD, (n, *res_BD.shape)))
    f, put = sharded(mesh, lambda x, w, r: api.proj_all_reduce(x, w, r, "tp", policy=policy, **kw), 3)
    return np.asarray(f(*put(x_nBK, w_nKD, res_n)))


def draw(rng, n, b, k, d, residual=True, res_dtype=BF16):
    """Per-rank x and w at a random scale, and a replicated residual of the output's size."""
    s = 10.0 ** rng.uniform(-1, 1)
    x = (rng.standard_normal((n, b, k)) * s).astype(BF16)
    w = (rng.standard_normal((n, k, d)) / np.sqrt(k * n)).astype(BF16)
    res = (rng.standard_normal((b, d)) * s).astype(res_dtype) if residual else None
    return x, w, res


def check(mesh, rng):
    n = mesh.size
    rows = []
    cases = [
        (b, k, d, res)
        for (k, d) in ((768, 7168), (1536, 7168), (1792, 3584))
        for b in (1, 8, 64)
        for res in (True, False)
    ]
    cases += [
        (int(rng.integers(1, 65)), 32 * int(rng.integers(2, 80)), 64 * int(rng.integers(1, 129)), bool(rng.integers(2)))
        for _ in range(6)
    ]
    for b, k, d, res in cases:
        x, w, r = draw(rng, n, b, k, d, res)
        ref, scale = oracle(x, w, r)
        row = dict(shape=[b, k, d], residual=res)
        for backend in (LS, "xla"):
            y = run_proj(mesh, x, w, r, policy=POLICIES[backend])
            row[backend] = dict(ok=not bool(proj_bad(y, ref, scale)), max_rel_err=max_rel_err(y[0], ref))
        row["ok"] = row[LS]["ok"] and row["xla"]["ok"]
        rows.append(row)
        print(row, flush=True)
    return rows


# (B, K, D, residual) of the two calls per stress step. The B = 1 call is the case that exposed the oracle bug
# in normal() below (results/fused_projection_diagnosis.json, bench/history.md).
PAIR = ((4, 768, 7168, True), (1, 1536, 3584, False))


def stress(mesh, steps=300, seed=0, calls=PAIR):
    """`steps` loop iterations on device, each running `calls` back to back on fresh random data.

    Data is drawn on device inside the loop (per step and rank), and the only other kernels between the
    Pallas calls are the RNG and the local XLA dots the host check needs (no NCCL, no host sync), so a rank
    that reads a stale signal or a peer's previous buffer gives a wrong sum, which the host check counts.
    """
    n = mesh.size

    def normal(key, shape, std):
        # round_to, not astype: at B = 1 XLA turns the oracle's f32 GEMV into a multiply-reduce fusion and, by
        # its excess-precision rule, drops the f32 -> bf16 -> f32 round trip, so the oracle (and XLA's own path)
        # saw the unrounded draws while the kernel read the bf16 ones: the "back-to-back bug" of earlier sessions.
        return common.round_to(jax.random.normal(key, shape, jnp.float32) * std, jnp.bfloat16)

    def loop(key):
        key = jax.random.wrap_key_data(key)
        me = jax.lax.axis_index("tp")

        def body(i, out):
            step_key = jax.random.fold_in(key, i)
            new = []
            for c, (b, k, d, has_res) in enumerate(calls):
                kr, k_me = jax.random.split(jax.random.fold_in(step_key, c))
                kx, kw = jax.random.split(jax.random.fold_in(k_me, me))
                x, w = normal(kx, (b, k), 1.0), normal(kw, (k, d), (k * n) ** -0.5)
                r = normal(kr, (b, d), 1.0) if has_res else None  # same key on every rank: a replicated residual
                y = api.proj_all_reduce(x, w, r, "tp", policy=FUSED)
                f32 = lambda a, b: jnp.dot(
                    a.astype(jnp.float32),
                    b.astype(jnp.float32),  # noqa: E731
                    precision=jax.lax.Precision.HIGHEST,
                )
                new += [y, jnp.zeros((b, d), jnp.bfloat16) if r is None else r, f32(x, w), f32(jnp.abs(x), jnp.abs(w))]
            return tuple(o.at[i].set(v) for o, v in zip(out, new, strict=True))

        shapes = []
        for b, _, d, _ in calls:
            shapes += [((b, d), jnp.bfloat16)] * 2 + [((b, d), jnp.float32)] * 2
        init = tuple(jnp.zeros((steps, *s), dt) for s, dt in shapes)
        return jax.lax.fori_loop(0, steps, body, init)

    keys = np.broadcast_to(np.asarray(jax.random.key_data(jax.random.key(seed))), (n, 2)).copy()
    f, put = sharded(mesh, loop, 1)
    t0 = time.perf_counter()
    outs = [np.asarray(v) for v in f(*put(keys))]
    wall = time.perf_counter() - t0
    report = dict(
        steps=steps,
        calls=len(calls) * steps,
        bad_calls=0,
        per_call=[],
        residual_ranks_identical=True,
        wall_s_incl_compile=wall,
    )
    for c, (b, k, d, has_res) in enumerate(calls):
        y, r, p, a = outs[4 * c : 4 * c + 4]
        # Host oracle: the FP32 local products summed over ranks in float64 (+ the residual).
        ref = p.astype(np.float64).sum(0) + r[0].astype(np.float64)
        scale = a.astype(np.float64).sum(0) + np.abs(r[0].astype(np.float64))
        bad = int(proj_bad(y, ref, scale, axis=(1, 2)).sum())
        report["bad_calls"] += bad
        report["residual_ranks_identical"] &= bool(np.all(r == r[:1]))
        report["per_call"].append(dict(B=b, K=k, D=d, residual=has_res, bad=bad, max_rel_err=max_rel_err(y[0], ref)))
    return report


# ----------------------------------------------------------------------------------------- timing
def variants():
    f32 = lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
    bf16 = lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return {
        "xla_f32": lambda x, w, r: reference.proj_all_reduce(x, w, r, "tp"),
        "xla_bf16": lambda x, w, r: r + jax.lax.psum(bf16(x, w), "tp"),
        "dot+ar": lambda x, w, r: r + api.all_reduce(bf16(x, w), "tp", policy=FUSED),
        "fused": lambda x, w, r: api.proj_all_reduce(x, w, r, "tp", policy=FUSED),
        "fused@d128": lambda x, w, r: api.proj_all_reduce(x, w, r, "tp", policy=FUSED, tile_d=128),
        "fused@s4": lambda x, w, r: api.proj_all_reduce(x, w, r, "tp", policy=FUSED, max_stages=4),
        "dot_only": lambda x, w, r: (r.astype(jnp.float32) + f32(x, w)).astype(r.dtype),
    }


@functools.cache
def chain_inputs(n, b, k, d):
    """Per rank: CHAIN activations and CHAIN weights (their own, so none sits in L2), one residual."""
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((n, CHAIN, b, k), np.float32).astype(BF16)
    ws = (rng.standard_normal((n, CHAIN, k, d), np.float32) * 0.02).astype(BF16)
    r = np.broadcast_to(rng.standard_normal((1, b, d), np.float32).astype(BF16), (n, b, d)).copy()
    return xs, ws, r


def build_chain(mesh, name):
    """jit(shard_map) of CHAIN dependent calls of variant `name`; takes CHAIN x's, CHAIN w's and a residual."""
    op = variants()[name]

    def chain(*a):
        # dependent calls through the residual, as in a layer stack; x and w arrive as separate arguments, so
        # no slice (a copy kernel in front of a custom call) sits between them and the op.
        xs, ws, r = a[:CHAIN], a[CHAIN : 2 * CHAIN], a[-1]
        for c in range(CHAIN):
            r = op(xs[c], ws[c], r)
        return r

    f, put = sharded(mesh, chain, 2 * CHAIN + 1)
    return f, lambda xs, ws, r: put(*(xs[:, c] for c in range(CHAIN)), *(ws[:, c] for c in range(CHAIN)), r)


def time_variant(mesh, name, b, k, d, repeats=5):
    from jax.experimental.mosaic.gpu import profiler

    n = mesh.size
    f, put = build_chain(mesh, name)
    args = put(*chain_inputs(n, b, k, d))
    per_call, kernels = [], {}
    for _ in range(repeats):
        _, timings = profiler.measure(f, aggregate=False)(*args)
        per_call.append(sum(t for _, t in timings) * 1e3 / (n * CHAIN))
        for kname, t in timings:
            kernels.setdefault(kname[:60], []).append(t * 1e3)
    per_kernel = {
        kname: dict(
            count_per_call=len(v) / (repeats * n * CHAIN), median_us=float(np.median(v)), min_us=float(np.min(v))
        )
        for kname, v in kernels.items()
    }
    return dict(
        op=name,
        batch=b,
        k=k,
        d=d,
        weight_bytes=k * d * 2,
        us_per_call=steady_us(per_kernel),
        us_per_call_mean_incl_skew=float(np.median(per_call)),
        kernels=per_kernel,
    )


def bench(mesh, rows, save):
    """Appends one row per variant to `rows` and saves after each, so a deadline keeps what was measured."""
    names = ("xla_f32", "xla_bf16", "dot+ar", "fused", "dot_only")
    grid = [(name, b, 768, 7168) for b in (1, 8, 64) for name in names]
    grid += [(name, 1, 768, 7168) for name in ("fused@d128", "fused@s4")]
    grid += [(name, b, 1536, 7168) for b in (1, 64) for name in ("xla_f32", "xla_bf16", "fused")]
    for name, b, k, d in grid:
        try:
            rows.append(time_variant(mesh, name, b, k, d))
            row = rows[-1]
            print(
                f"{name:12s} B={b:3d} K={k:5d} D={d:5d} {row['us_per_call']:8.2f} us/call  "
                + "  ".join(f"{kn[:28]}={v['median_us']:.2f}" for kn, v in row["kernels"].items()),
                flush=True,
            )
        except Exception as e:  # keep the other rows; the failure is recorded
            rows.append(dict(op=name, batch=b, k=k, d=d, error=repr(e)[:400]))
            print("FAILED", name, b, k, d, repr(e)[:400], flush=True)
        save()


def write_md(results, path):
    by = {(r["op"], r["batch"], r["k"], r["d"]): r for r in results.get("bench", []) if "us_per_call" in r}
    nan = float("nan")
    us = lambda op, b, k, d: by[(op, b, k, d)]["us_per_call"] if (op, b, k, d) in by else nan
    lines = [
        "# Row-parallel projection + all-reduce + residual on 2 x H200: device time per call (us), CUPTI",
        "",
        "Steady state: every kernel a call launches on a rank (GEMM, NCCL or Pallas, XLA's cross-device "
        f"barrier and semaphore memset for Pallas, the add), median over a chain of {CHAIN} dependent "
        "calls (own x and w each) x 5 runs x 2 ranks. 'fused kernel' = the fused row without the barrier "
        "kernel. 'HBM floor' = weight bytes / 4.8 TB/s.",
        "",
        "| K | D | batch | xla_f32 | xla_bf16 | dot + Pallas AR | fused | (fused kernel) | dot only | HBM floor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, d in ((768, 7168), (1536, 7168)):
        for b in (1, 8, 64):
            if ("xla_f32", b, k, d) not in by:
                continue
            fused_k = us("fused", b, k, d) - barrier_us(by[("fused", b, k, d)]) if ("fused", b, k, d) in by else nan
            lines.append(
                f"| {k} | {d} | {b} | {us('xla_f32', b, k, d):.2f} | {us('xla_bf16', b, k, d):.2f} | "
                f"{us('dot+ar', b, k, d):.2f} | {us('fused', b, k, d):.2f} | {fused_k:.2f} | "
                f"{us('dot_only', b, k, d):.2f} | {k * d * 2 / 4.8e12 * 1e6:.2f} |"
            )
    lines += [
        "",
        "Fused-kernel tiles at B = 1, K = 768, D = 7168: default (tile_d 64, 8 stages) "
        f"{us('fused', 1, 768, 7168):.2f}, tile_d 128 {us('fused@d128', 1, 768, 7168):.2f}, "
        f"4 stages {us('fused@s4', 1, 768, 7168):.2f}.",
    ]
    if "check" in results:
        bad = [r for r in results["check"] if not r["ok"]]
        lines += [
            "",
            f"Correctness vs float64 (one output rounding + FP32 accumulation allowance), ranks "
            f"bit-identical: {len(results['check']) - len(bad)}/{len(results['check'])} cases ok"
            + (f"; failures: {bad}" if bad else ""),
        ]
    if "stress" in results:
        lines += [
            "",
            f"Stress (back-to-back fused calls, fresh random data, every result checked): {results['stress']}",
        ]
    lines += [
        "",
        f"Device: {results.get('device', '?')}, jax {results.get('jax', '?')}. "
        "Per-kernel medians in fused_projection.json.",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--stress-steps", type=int, default=300)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--deadline-s", type=int, default=540)
    a = ap.parse_args()
    mesh, results, save = two_gpu_run(a.out, "fused_projection", write_md, a.deadline_s)
    if a.check:
        results["check"] = check(mesh, np.random.default_rng())
        save()
        results["stress"] = stress(mesh, a.stress_steps, seed=int(np.random.default_rng().integers(2**31)))
        print("stress", results["stress"], flush=True)
        save()
    if a.bench:
        results["bench"] = []
        bench(mesh, results["bench"], save)


if __name__ == "__main__":
    main()
