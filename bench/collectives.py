"""All-reduce of decode-sized activations on 2 GPUs: XLA psum (NCCL) vs the Pallas one-shot kernels.

  python bench/collectives.py --check --out DIR   # correctness at real shapes + the back-to-back stress test
  python bench/collectives.py --bench --out DIR   # CUPTI device time per call, all kernels of a call summed

Device time per call = every kernel the call launches on a rank (XLA's cross-device barrier kernel, the
semaphore memset, the Pallas kernel; or NCCL's kernel), summed, averaged over ranks and over a chain of
CHAIN dependent calls. Writes DIR/collectives.json and DIR/collectives.md.
"""

import argparse
import faulthandler
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels.collectives import api, reference  # noqa: E402
from pallas_kernels.policy import SPECIALIZED  # noqa: E402

BF16 = ml_dtypes.bfloat16
EPS = 1e-5
CHAIN = 8
NVLINK_BYTES_PER_S = 450e9  # H200 NVLink 4: 18 links x 25 GB/s per direction


def make_mesh(n=2):
    return jax.make_mesh((n,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:n])


def two_gpu_run(out, name, write_md, deadline_s):
    """What every 2-GPU bench run starts with: a deadline that ends a deadlocked kernel before it eats the
    device budget, the mesh, and a results dict that save() writes as {name}.json and {name}.md in `out`."""
    faulthandler.dump_traceback_later(deadline_s, exit=True)
    os.makedirs(out, exist_ok=True)
    results = dict(device=f"{len(jax.devices())} x {jax.devices()[0].device_kind}", jax=jax.__version__)

    def save():
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(results, f, indent=1)
        write_md(results, os.path.join(out, f"{name}.md"))

    return make_mesh(2), results, save


def sharded(mesh, fn, n_in):
    """jit(shard_map(fn)) over operands/results with a leading rank axis; returns (call, put)."""
    inner = lambda *a: jax.tree.map(lambda y: y[None], fn(*(v[0] for v in a)))
    f = jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=(P("tp"),) * n_in, out_specs=P("tp"), check_vma=False))
    put = lambda *a: [jax.device_put(v, NamedSharding(mesh, P("tp"))) for v in a]
    return f, put


# ------------------------------------------------------------------------------------ correctness
def np_add_rmsnorm(x_n, res, w, eps=EPS):
    s = x_n.astype(np.float64).sum(0)
    new = (res.astype(np.float64) + s).astype(BF16)
    nf = new.astype(np.float64)
    inv = 1.0 / np.sqrt(np.mean(nf * nf, axis=-1, keepdims=True) + eps)
    return new, ((nf * inv).astype(BF16).astype(np.float64) * w.astype(np.float64)).astype(BF16)


def sum_errors(y_n, x_n, per_step=False):
    """Bad if off the f64 sum by more than one BF16 rounding or if ranks differ; per step: one flag per index
    of the axis after the rank axis. Also returns the largest relative error."""
    x64 = x_n.astype(np.float64)
    ref, y0 = x64.sum(0), y_n[0].astype(np.float64)
    tol = float(jnp.finfo(jnp.bfloat16).eps) * np.abs(x64).sum(0) + 1e-30
    bad = (np.abs(y0 - ref) > tol) | np.any(y_n.view(np.uint16) != y_n[:1].view(np.uint16), axis=0)
    bad = bad.reshape(bad.shape[0], -1).any(1) if per_step else bad.any()
    return bad, float(np.max(np.abs(y0 - ref) / (np.abs(ref) + 1e-3)))


def ulps(a, ref):
    """|a - ref| in BF16 ulps of ref (ulp = 2^(exponent - 7)); zeros of ref use the smallest normal's ulp."""
    a, ref = a.astype(np.float64), ref.astype(np.float64)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(ref), 2.0**-126))) - 7)
    return np.abs(a - ref) / ulp


# The kernel sums in FP32 and the oracle in FP64: new may round 1 ulp apart (FP32 double rounding), and the
# normed output, two roundings later and with a different sum-of-squares order, up to 3. A stale or racing
# read is off by O(1) relative, i.e. ~100+ ulps.
NEW_ULPS, NORMED_ULPS = 1, 3


def fused_ok(new, normed, ref_new, ref_normed, axis=None):
    ok_new = ulps(new, ref_new).max(axis=axis) <= NEW_ULPS
    return ok_new & (ulps(normed, ref_normed).max(axis=axis) <= NORMED_ULPS)


def check(mesh, rng):
    n = mesh.size
    rows = []
    cases = [(b, d) for d in (7168, 3584) for b in (1, 8, 64)] + [
        (int(rng.integers(1, 65)), 128 * int(rng.integers(1, 64))) for _ in range(6)
    ]
    for b, d in cases:
        x = (rng.standard_normal((n, b, d)) * 10.0 ** rng.uniform(-2, 2)).astype(BF16)
        for alg in ("one_shot", "one_shot_st"):
            f, put = sharded(mesh, lambda v, alg=alg: api.all_reduce(v, "tp", policy=SPECIALIZED, algorithm=alg), 1)
            y = np.asarray(f(*put(x)))
            bad, rel = sum_errors(y, x)
            rows.append(dict(op=alg, shape=[b, d], ok=not bool(bad), max_rel_err=rel))
            print(rows[-1], flush=True)
        if d // 128 <= 256:
            res = np.broadcast_to(rng.standard_normal((b, d)).astype(BF16), (n, b, d)).copy()
            w = np.broadcast_to((1 + 0.1 * rng.standard_normal(d)).astype(BF16), (n, d)).copy()
            f, put = sharded(
                mesh, lambda v, r, g: api.all_reduce_add_rmsnorm(v, r, g, EPS, "tp", policy=SPECIALIZED), 3
            )
            new, normed = (np.asarray(a) for a in f(*put(x, res, w)))
            rn, rnorm = np_add_rmsnorm(x, res[0], w[0])
            same = all(
                np.array_equal(a[r].view(np.uint16), a[0].view(np.uint16)) for a in (new, normed) for r in range(n)
            )
            ok = bool(fused_ok(new[0], normed[0], rn, rnorm) and same)
            rows.append(
                dict(
                    op="one_shot_add_rmsnorm",
                    shape=[b, d],
                    ok=ok,
                    ranks_identical=same,
                    max_ulps_new=float(ulps(new[0], rn).max()),
                    max_ulps_normed=float(ulps(normed[0], rnorm).max()),
                )
            )
            print(rows[-1], flush=True)
    return rows


def stress(mesh, steps=2000, seed=0):
    """`steps` loop iterations, each four different kernels back to back on fresh random data.

    No NCCL call or host sync sits between the Pallas calls, so a rank that reads a stale signal or a
    peer's previous buffer produces a wrong sum, which the host check below counts.
    """
    n = mesh.size
    rng = np.random.default_rng(seed)
    xa = rng.standard_normal((n, steps, 1, 7168)).astype(BF16)  # one-shot, batch-1 hidden
    xb = rng.standard_normal((n, steps, 2, 3584)).astype(BF16)  # one-shot, MoE latent
    xc = rng.standard_normal((n, steps, 1, 7168)).astype(BF16)  # fused add + RMSNorm
    xd = rng.standard_normal((n, steps, 8, 7168)).astype(BF16)  # one-shot, plain stores
    res = np.broadcast_to(rng.standard_normal((1, steps, 1, 7168)).astype(BF16), (n, steps, 1, 7168)).copy()
    w = np.broadcast_to((1 + 0.1 * rng.standard_normal(7168)).astype(BF16), (n, 7168)).copy()

    def loop(xa, xb, xc, xd, res, w):
        def body(i, out):
            ya, yb, new, normed, yd = out
            a = api.all_reduce(xa[i], "tp", policy=SPECIALIZED, algorithm="one_shot")
            b = api.all_reduce(xb[i], "tp", policy=SPECIALIZED, algorithm="one_shot")
            c, d = api.all_reduce_add_rmsnorm(xc[i], res[i], w, EPS, "tp", policy=SPECIALIZED)
            e = api.all_reduce(xd[i], "tp", policy=SPECIALIZED, algorithm="one_shot_st")
            return ya.at[i].set(a), yb.at[i].set(b), new.at[i].set(c), normed.at[i].set(d), yd.at[i].set(e)

        init = tuple(jnp.zeros_like(v) for v in (xa, xb, xc, xc, xd))
        return jax.lax.fori_loop(0, steps, body, init)

    f, put = sharded(mesh, loop, 6)
    t0 = time.perf_counter()
    ya, yb, new, normed, yd = (np.asarray(a) for a in f(*put(xa, xb, xc, xd, res, w)))
    wall = time.perf_counter() - t0
    bad_a, _ = sum_errors(ya, xa, per_step=True)
    bad_b, _ = sum_errors(yb, xb, per_step=True)
    bad_d, _ = sum_errors(yd, xd, per_step=True)
    rn, rnorm = np_add_rmsnorm(xc, res[0], w[0])
    same_c = np.all(new.view(np.uint16) == new[:1].view(np.uint16), axis=(0, 2, 3)) & np.all(
        normed.view(np.uint16) == normed[:1].view(np.uint16), axis=(0, 2, 3)
    )
    bad_c = ~(fused_ok(new[0], normed[0], rn, rnorm, axis=(1, 2)) & same_c)
    n_bad = int(bad_a.sum() + bad_b.sum() + bad_c.sum() + bad_d.sum())
    return dict(
        steps=steps,
        calls=4 * steps,
        bad_calls=n_bad,
        bad_one_shot=int(bad_a.sum()),
        bad_one_shot_latent=int(bad_b.sum()),
        bad_fused=int(bad_c.sum()),
        bad_one_shot_st=int(bad_d.sum()),
        fused_max_ulps_new=float(ulps(new[0], rn).max()),
        fused_max_ulps_normed=float(ulps(normed[0], rnorm).max()),
        wall_s_incl_compile=wall,
    )


# ----------------------------------------------------------------------------------------- timing
def variants():
    return {
        "psum": (1, lambda x: jax.lax.psum(x, "tp")),
        "one_shot": (1, lambda x: api.all_reduce(x, "tp", policy=SPECIALIZED, algorithm="one_shot")),
        "one_shot_st": (1, lambda x: api.all_reduce(x, "tp", policy=SPECIALIZED, algorithm="one_shot_st")),
        "one_shot@4k": (
            1,
            lambda x: api.all_reduce(x, "tp", policy=SPECIALIZED, algorithm="one_shot", block_bytes=4096),
        ),
        "one_shot_st@4k": (
            1,
            lambda x: api.all_reduce(x, "tp", policy=SPECIALIZED, algorithm="one_shot_st", block_bytes=4096),
        ),
        "psum_add_rmsnorm": (3, lambda x, r, w: reference.all_reduce_add_rmsnorm(x, r, w, EPS, "tp")),
        "one_shot_add_rmsnorm": (3, lambda x, r, w: api.all_reduce_add_rmsnorm(x, r, w, EPS, "tp", policy=SPECIALIZED)),
        # a layer boundary: all-reduce + prefix update + AttnRes over MIX_BLOCKS stored blocks (each its own
        # operand, as the model holds them) + RMSNorm
        "psum_mix_norm": (
            3 + MIX_BLOCKS,
            lambda x, p, w, *blk: reference.all_reduce_mix_norm(x, p, blk, w, w, w, EPS, "tp"),
        ),
        "mix_norm": (
            3 + MIX_BLOCKS,
            lambda x, p, w, *blk: api.all_reduce_mix_norm(x, p, blk, w, w, w, EPS, "tp", policy=SPECIALIZED),
        ),
    }


MIX_BLOCKS = 8  # the most a K3 layer mixes: blocks at layers 0, 12, ..., 84, plus the live prefix


def time_variant(mesh, name, b, d, repeats=5):
    from jax.experimental.mosaic.gpu import profiler

    n_in, op = variants()[name]

    def chain(*a):
        x, rest = a[0], a[1:]
        for _ in range(CHAIN):  # dependent calls, as in a layer stack
            out = op(x, *rest)
            x = out[1] if isinstance(out, tuple) else out
        return x

    f, put = sharded(mesh, chain, n_in)
    rng = np.random.default_rng(0)
    args = [(rng.standard_normal((mesh.size, b, d)) * 0.01).astype(BF16)]  # bf16 * float is float32
    if n_in >= 3:  # residual / prefix, norm weight, then the stored blocks
        args += [rng.standard_normal((mesh.size, b, d)).astype(BF16), np.ones((mesh.size, d), BF16)]
    args += [rng.standard_normal((mesh.size, b, d)).astype(BF16) for _ in range(n_in - len(args))]
    args = put(*args)
    per_call, kernels = [], {}
    for _ in range(repeats):
        _, timings = profiler.measure(f, aggregate=False)(*args)
        per_call.append(sum(t for _, t in timings) * 1e3 / (mesh.size * CHAIN))
        for k, t in timings:
            kernels.setdefault(k[:60], []).append(t * 1e3)
    per_kernel = {
        k: dict(
            count_per_call=len(v) / (repeats * mesh.size * CHAIN),
            median_us=float(np.median(v)),
            min_us=float(np.min(v)),
        )
        for k, v in kernels.items()
    }
    return dict(
        op=name,
        batch=b,
        d=d,
        bytes=b * d * 2,
        us_per_call=steady_us(per_kernel),
        us_per_call_mean_incl_skew=float(np.median(per_call)),
        kernels=per_kernel,
    )


def bench(mesh, ops=None, rows=None, save=lambda: None):
    """Every (op, batch, D) row of the grid, or only those of `ops`, appended to `rows`; save() after each row
    (a deadline may end the run)."""
    rows = [] if rows is None else rows
    grid = [(name, b, 7168) for b in (1, 2, 4, 8, 16, 32, 64) for name in ("psum", "one_shot", "one_shot_st")]
    grid += [(name, b, 7168) for b in (1, 8, 64) for name in ("one_shot@4k", "one_shot_st@4k")]
    grid += [(name, b, 3584) for b in (1, 8, 64) for name in ("psum", "one_shot", "one_shot_st")]
    grid += [(name, b, 7168) for b in (1, 8, 64) for name in ("psum_add_rmsnorm", "one_shot_add_rmsnorm")]
    grid += [(name, b, 7168) for b in (1, 8, 64) for name in ("psum_mix_norm", "mix_norm")]
    grid += [("one_shot", 1, 128), ("one_shot_st", 1, 128)]  # 256 B: latency floor of the push protocols
    for name, b, d in [g for g in grid if ops is None or g[0] in ops]:
        try:
            rows.append(time_variant(mesh, name, b, d))
            r = rows[-1]
            print(
                f"{name:22s} B={b:3d} D={d:5d} {r['us_per_call']:8.2f} us/call  "
                + "  ".join(f"{k[:28]}={v['median_us']:.2f}" for k, v in r["kernels"].items()),
                flush=True,
            )
        except Exception as e:  # keep the other rows; the failure is recorded
            rows.append(dict(op=name, batch=b, d=d, error=repr(e)[:400]))
            print("FAILED", name, b, d, repr(e)[:400], flush=True)
        save()
    return rows


def steady_us(per_kernel):
    """Steady state (ranks in lockstep, as inside a decode step): per kernel kind, the median over the chain
    positions of each position's median, times the kind's count per call. XLA names each call's kernels
    apart (psum_56..., psum_57...), digits are dropped to group them. The plain mean also carries the host
    launch skew between the two GPUs, which one call of each chain absorbs (tens of us)."""
    groups = {}
    for k, v in per_kernel.items():
        groups.setdefault(re.sub(r"\d+", "#", k), []).append(v)
    return sum(
        float(np.median([v["median_us"] for v in vs])) * sum(v["count_per_call"] for v in vs) for vs in groups.values()
    )


def barrier_us(row):
    """Median time of XLA's cross-device barrier kernel in a Pallas row (0 if none was found)."""
    return sum(
        v["median_us"] * v["count_per_call"] for k, v in row.get("kernels", {}).items() if "barrier" in k.lower()
    )


def write_md(results, path):
    by = {(r["op"], r["batch"], r["d"]): r for r in results.get("bench", []) if "us_per_call" in r}
    us = lambda op, b, d: steady_us(by[(op, b, d)]["kernels"]) if (op, b, d) in by else float("nan")
    nan = float("nan")
    kernel_only = lambda op, b, d: us(op, b, d) - barrier_us(by[(op, b, d)]) if (op, b, d) in by else nan
    lat = kernel_only("one_shot_st", 1, 128)
    lines = [
        "# All-reduce on 2 x H200: device time per call (us), CUPTI",
        "",
        "Steady state: every kernel a call launches on a rank (NCCL's kernel; or the semaphore memset, "
        "XLA's cross-device barrier kernel and the Pallas kernel), median over a chain of "
        f"{CHAIN} dependent calls x 5 runs x 2 ranks. 'kernel' = the Pallas kernel plus memset, "
        "without the barrier kernel. "
        f"Floor = a 256 B plain-store push measured as a kernel ({lat:.2f} us) + bytes / "
        f"{NVLINK_BYTES_PER_S / 1e9:.0f} GB/s.",
        "",
        "| D | batch | KB | psum | one-shot TMA | one-shot st | (st kernel) | barrier | floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for d in (7168, 3584):
        for b in (1, 2, 4, 8, 16, 32, 64):
            if ("psum", b, d) not in by:
                continue
            bar = barrier_us(by[("one_shot_st", b, d)]) if ("one_shot_st", b, d) in by else float("nan")
            floor = lat + b * d * 2 / NVLINK_BYTES_PER_S * 1e6
            lines.append(
                f"| {d} | {b} | {b * d * 2 / 1024:.0f} | {us('psum', b, d):.2f} | "
                f"{us('one_shot', b, d):.2f} | "
                f"{us('one_shot_st', b, d):.2f} | {kernel_only('one_shot_st', b, d):.2f} | {bar:.2f} | "
                f"{floor:.2f} |"
            )
    lines += [
        "",
        "Block size (D = 7168): per-CTA block 16 KB (default) vs 4 KB",
        "",
        "| batch | one-shot TMA 16K | 4K | one-shot st 16K | 4K |",
        "|---|---|---|---|---|",
    ]
    for b in (1, 8, 64):
        lines.append(
            f"| {b} | {us('one_shot', b, 7168):.2f} | {us('one_shot@4k', b, 7168):.2f} | "
            f"{us('one_shot_st', b, 7168):.2f} | {us('one_shot_st@4k', b, 7168):.2f} |"
        )
    lines += [
        "",
        "Fused all-reduce + residual add + RMSNorm (D = 7168):",
        "",
        "| batch | XLA psum + add + norm | Pallas fused | (kernel) |",
        "|---|---|---|---|",
    ]
    for b in (1, 8, 64):
        lines.append(
            f"| {b} | {us('psum_add_rmsnorm', b, 7168):.2f} | "
            f"{us('one_shot_add_rmsnorm', b, 7168):.2f} | "
            f"{kernel_only('one_shot_add_rmsnorm', b, 7168):.2f} |"
        )
    lines += [
        "",
        f"Layer boundary: all-reduce + prefix add + AttnRes over {MIX_BLOCKS} blocks + RMSNorm (D = 7168):",
        "",
        "| batch | XLA psum + AttnRes + norm | Pallas mix_norm | (kernel) |",
        "|---|---|---|---|",
    ]
    for b in (1, 8, 64):
        lines.append(
            f"| {b} | {us('psum_mix_norm', b, 7168):.2f} | {us('mix_norm', b, 7168):.2f} | "
            f"{kernel_only('mix_norm', b, 7168):.2f} |"
        )
    if "stress" in results:
        lines += ["", f"Stress (back-to-back calls, fresh random data, every result checked): {results['stress']}"]
    if "check" in results:
        bad = [r for r in results["check"] if not r["ok"]]
        lines += [
            "",
            f"Correctness vs float64 sum, ranks bit-identical: {len(results['check']) - len(bad)}/"
            f"{len(results['check'])} cases ok" + (f"; failures: {bad}" if bad else ""),
        ]
    lines += [
        "",
        f"Device: {results.get('device', '?')}, jax {results.get('jax', '?')}. Per-kernel medians in collectives.json.",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--stress-steps", type=int, default=2000)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--deadline-s", type=int, default=540)
    ap.add_argument(
        "--ops", default=None, help="comma-separated ops: time only these rows, keep the others from --base"
    )
    ap.add_argument("--base", default="bench/results/collectives.json", help="earlier results --ops adds to")
    a = ap.parse_args()
    mesh, results, save = two_gpu_run(a.out, "collectives", write_md, a.deadline_s)
    if a.check:
        results["check"] = check(mesh, np.random.default_rng())
        save()
        results["stress"] = stress(mesh, a.stress_steps, seed=int(np.random.default_rng().integers(2**31)))
        print("stress", results["stress"], flush=True)
        save()
    if a.bench:
        ops = None if a.ops is None else set(a.ops.split(","))
        results["bench"] = []
        if ops is not None and os.path.exists(a.base):  # the rows not re-run come from the earlier results
            with open(a.base) as f:
                old = json.load(f)
            for k, v in old.items():
                results.setdefault(k, v)
            results["bench"] = [r for r in old.get("bench", []) if r["op"] not in ops]
        bench(mesh, ops, results["bench"], save)


if __name__ == "__main__":
    main()
