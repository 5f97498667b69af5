"""MLA decode attention (pallas_kernels.mla_decode) on one GPU: the sm90 kernel (with its XLA prep and split
combine, as the api runs it) against the XLA reference, at one tensor-parallel rank's heads (TP16: 6, TP8: 12),
batch 1 / 8 / 64, context 1K / 8K / 32K, the fp8 latent cache (k3jax.cache's default), one query token.

  PYTHONPATH=. JAX_PLATFORMS=cuda python3 bench/mla_layer.py OUT_DIR [--quick] [--cache fp8|bf16]
      [--deadline-s 270]
  PYTHONPATH=. JAX_PLATFORMS=cuda python3 bench/mla_layer.py OUT_DIR --variants   (launch variants, VARIANTS,
      at TP16 / TP8 x B = 1 / 64 x 8K, equal lengths, fp8 -> OUT_DIR/mla_variants.json, ~2 min)
  PYTHONPATH=. JAX_PLATFORMS=cuda,cpu python3 bench/mla_layer.py OUT_DIR --profile   (where a block's time goes:
      the kernel alone at TP16, B = 1 and 64, 8K, fp8, its in-kernel trace of each block's phases (wait for the
      TMA, convert fp8 -> f16, qk, softmax, pv) -> OUT_DIR/mla_profile.json, ~1 min)
  PYTHONPATH=. JAX_PLATFORMS=cuda python3 bench/mla_layer.py OUT_DIR --once B   (one call of the kernel alone,
      TP16, 8K, fp8, equal lengths, for a profiler: bench/gpu_runs.sh mla_ncu)
  (GPU; writes OUT_DIR/mla_layer.{json,md}; --quick: B = 1 and 64 at 8K only; --cache bf16: the bf16 cache,
  written as mla_layer_bf16.{json,md}; rows not started by the deadline are skipped and listed)

Lengths: "equal" (every sequence holds the whole context) or "ragged" (1, 17, ctx - 1, then uniform in
1 .. ctx). Floor: the bytes of the valid rows and their scales read once (sum over sequences of length x (576
+ 8) for fp8, x 1152 for bf16) at 4.8 TB/s; the XLA reference dequantises the whole cache (capacity = ctx)
whatever the lengths. The kernel column is the api's whole path (prep, kernel, combine: "kernels" lists them);
"kernel alone" is the Mosaic kernel's own time. CUPTI device time, median of bench/device_time's runs.
"""

import functools
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.device_time import device_us, per_kernel_us  # noqa: E402
from bench.kernel_trace import phases  # noqa: E402
from pallas_kernels.mla_decode import kernel, reference, sm90  # noqa: E402

HBM_PEAK = 4.8e12  # H200 datasheet
R, E = 512, 64
SCALE = 192**-0.5
ITERS = 20
HEADS = {16: 6, 8: 12}  # tp -> local heads
BATCHES = (1, 8, 64)
CONTEXTS = (8192, 1024, 32768)  # the targets (8K) first, should the deadline cut the run short


def make_cache(key, B, S, cache):
    """Random rows quantised by k3jax.cache's rule (per row, c and k_pe each max / 448), built on the device."""
    x = jax.random.normal(key, (B, S, R + E), jnp.float32)
    if cache == "bf16":
        return {"rows": x.astype(jnp.bfloat16)}
    sc = jnp.maximum(jnp.stack([jnp.abs(x[..., :R]).max(-1), jnp.abs(x[..., R:]).max(-1)], -1) / 448.0, 1e-30)
    q = jnp.concatenate([x[..., :R] / sc[..., :1], x[..., R:] / sc[..., 1:]], -1).astype(jnp.float8_e4m3fn)
    return {"rows": q, "scales": sc}


def lengths(B, S, kind, seed):
    if kind == "equal":
        return np.full((B, 1), S, np.int32)
    r = np.random.default_rng(seed)
    lens = np.concatenate([[1, 17, S - 1], r.integers(1, S + 1, max(0, B - 3))])[:B]
    return lens.astype(np.int32)[:, None]


def row_bytes(cache):
    return (R + E) + 8 if cache == "fp8" else (R + E) * 2


def measure(f, args, iters=ITERS):
    """(device us, [(kernel, us)]) of the jitted f(*args), or a failure string."""
    try:
        us = device_us(f, *args, iters=iters)
        kernels = [(k, round(t, 2)) for k, t in per_kernel_us(f, *args, iters=5)]
        return us, kernels
    except Exception as e:  # noqa: BLE001
        return f"failed: {type(e).__name__}: {e}"[:300], []


def _kernel(q_lat, q_pe, entry, key_len):
    return sm90.mla_decode_attention(q_lat, q_pe, entry, key_len, scale=SCALE)


def _xla(q_lat, q_pe, entry, key_len):
    return reference.mla_decode_attention(q_lat, q_pe, entry, key_len, scale=SCALE)


F_KERNEL, F_XLA = jax.jit(_kernel), jax.jit(_xla)  # one compile per shape, shared by equal and ragged lengths


def main(out_dir, quick=False, cache="fp8", deadline_s=270.0):
    t0 = time.time()
    dev = jax.devices()[0]
    name = "mla_layer" if cache == "fp8" else f"mla_layer_{cache}"
    results = dict(
        device=f"{dev.device_kind} (cc {getattr(dev, 'compute_capability', '?')})",
        jax=jax.__version__,
        cache=cache,
        tuning=sm90.TUNING,
        measure=f"CUPTI device time, median of {ITERS} calls; floor = valid rows + scales once at 4.8 TB/s",
        rows=[],
        skipped=[],
    )
    batches, contexts = ((1, 64), (8192,)) if quick else (BATCHES, CONTEXTS)
    key = jax.random.key(0)
    for S in contexts:
        for B in batches:
            if time.time() - t0 > deadline_s:
                results["skipped"].append(dict(B=B, ctx=S))
                continue
            key, k_cache, k_q = jax.random.split(key, 3)
            entry = make_cache(k_cache, B, S, cache)
            for tp, H in HEADS.items():
                kq1, kq2 = jax.random.split(jax.random.fold_in(k_q, tp))
                q_lat = jax.random.normal(kq1, (B, 1, H, R), jnp.float32).astype(jnp.bfloat16)
                q_pe = (0.5 * jax.random.normal(kq2, (B, 1, H, E), jnp.float32)).astype(jnp.bfloat16)
                for kind in ("equal", "ragged"):
                    if time.time() - t0 > deadline_s:
                        results["skipped"].append(dict(tp=tp, B=B, ctx=S, lengths=kind))
                        continue
                    lens = lengths(B, S, kind, seed=B * S)
                    key_len = jnp.asarray(lens)
                    nbytes = int(lens.max(axis=1).sum()) * row_bytes(cache)
                    row = dict(tp=tp, H=H, B=B, ctx=S, lengths=kind, MB=nbytes / 1e6, floor_us=nbytes / HBM_PEAK * 1e6)
                    launch = sm90.launch_for(q_lat, q_pe, entry)
                    row["launch"] = dict(vars(launch))
                    f_k, f_x = F_KERNEL, F_XLA
                    try:
                        got = np.asarray(f_k(q_lat, q_pe, entry, key_len), np.float64)
                        want = np.asarray(f_x(q_lat, q_pe, entry, key_len), np.float64)
                        row["rel_err_vs_xla"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                    except Exception as e:  # noqa: BLE001
                        row["rel_err_vs_xla"] = f"failed: {type(e).__name__}: {e}"[:300]
                    row["pallas_us"], row["pallas_kernels"] = measure(f_k, (q_lat, q_pe, entry, key_len))
                    row["xla_us"], row["xla_kernels"] = measure(f_x, (q_lat, q_pe, entry, key_len))
                    mosaic = [t for k, t in row["pallas_kernels"] if "mosaic" in k.lower() or "_body" in k]
                    row["kernel_alone_us"] = sum(mosaic) if mosaic else None
                    if isinstance(row["pallas_us"], float):
                        row["pct_of_floor"] = 100 * row["floor_us"] / row["pallas_us"]
                        if row["kernel_alone_us"]:
                            row["kernel_alone_pct_hbm"] = 100 * row["floor_us"] / row["kernel_alone_us"]
                        if isinstance(row["xla_us"], float):
                            row["vs_xla"] = row["xla_us"] / row["pallas_us"]
                    results["rows"].append(row)
                    print(json.dumps({k: v for k, v in row.items() if not k.endswith("kernels")}), flush=True)
                    pathlib.Path(out_dir, f"{name}.json").write_text(json.dumps(results, indent=1))
            del entry
    results["wall_s"] = time.time() - t0
    pathlib.Path(out_dir, f"{name}.json").write_text(json.dumps(results, indent=1))
    pathlib.Path(out_dir, f"{name}.md").write_text(markdown(results))


VARIANT_CTX, VARIANT_BATCHES = 8192, (1, 64)
VARIANTS = {  # tuning changes against tuning.json's entry
    "tuned": {},
    "acc add": dict(acc="add", max_cols=16),
    "qk_regs": dict(qk_regs=True),
    "fp8 stages 3": dict(stages={"fp8": 3, "bf16": 2}),  # the launch before the twenty-ninth session
    "min_split_blocks 2": dict(min_split_blocks=2, max_splits=64),  # likewise: 1 x 8K as 64 CTAs of 2 blocks
    "min_split_blocks 4": dict(min_split_blocks=4),
    "ctas 192": dict(ctas=192),  # 64 x 8K: 3 splits, 1.45 waves (the launch before whole waves)
    "ctas 264": dict(ctas=264),
}


def main_variants(out_dir, deadline_s=200.0):
    """Each VARIANTS launch at the issue's target shapes (8K positions, equal lengths, fp8): device us of the
    api path and of the Mosaic kernel alone, and the error against the XLA reference."""
    t0 = time.time()
    dev = jax.devices()[0]
    results = dict(device=dev.device_kind, jax=jax.__version__, tuning=sm90.TUNING, rows=[], skipped=[])
    S = VARIANT_CTX
    key = jax.random.key(1)
    for B in VARIANT_BATCHES:
        key, k_cache, k_q = jax.random.split(key, 3)
        entry = make_cache(k_cache, B, S, "fp8")
        key_len = jnp.full((B, 1), S, jnp.int32)
        nbytes = B * S * row_bytes("fp8")
        for tp, H in HEADS.items():
            kq1, kq2 = jax.random.split(jax.random.fold_in(k_q, tp))
            q_lat = jax.random.normal(kq1, (B, 1, H, R), jnp.float32).astype(jnp.bfloat16)
            q_pe = (0.5 * jax.random.normal(kq2, (B, 1, H, E), jnp.float32)).astype(jnp.bfloat16)
            want = np.asarray(F_XLA(q_lat, q_pe, entry, key_len), np.float64)
            for name, changes in VARIANTS.items():
                if time.time() - t0 > deadline_s:
                    results["skipped"].append(dict(tp=tp, B=B, variant=name))
                    continue
                tuning = dict(sm90.TUNING, **changes)
                f = jax.jit(
                    lambda q_lat, q_pe, entry, key_len, tuning=tuning: sm90.mla_decode_attention(
                        q_lat, q_pe, entry, key_len, scale=SCALE, tuning=tuning
                    )
                )
                row = dict(tp=tp, B=B, ctx=S, variant=name, floor_us=nbytes / HBM_PEAK * 1e6)
                row["launch"] = dict(vars(sm90.launch_for(q_lat, q_pe, entry, tuning)))
                try:
                    got = np.asarray(f(q_lat, q_pe, entry, key_len), np.float64)
                    row["rel_err_vs_xla"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                except Exception as e:  # noqa: BLE001
                    row["rel_err_vs_xla"] = f"failed: {type(e).__name__}: {e}"[:300]
                row["pallas_us"], row["pallas_kernels"] = measure(f, (q_lat, q_pe, entry, key_len))
                mosaic = [t for k, t in row["pallas_kernels"] if "mosaic" in k.lower() or "_body" in k]
                row["kernel_alone_us"] = sum(mosaic) if mosaic else None
                results["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "pallas_kernels"}), flush=True)
                pathlib.Path(out_dir, "mla_variants.json").write_text(json.dumps(results, indent=1))
        del entry
    results["wall_s"] = time.time() - t0
    pathlib.Path(out_dir, "mla_variants.json").write_text(json.dumps(results, indent=1))


def main_profile(out_dir, batches=(1, 64), S=8192, H=6):
    """The Mosaic kernel alone at one TP16 rank's heads, equal lengths, fp8: CUPTI time and the in-kernel trace's
    mean span of each phase of a block (a warpgroup's blocks: count / CTAs), against the block's share of the
    floor (its 64 rows' bytes at the kernel's fair share of 4.8 TB/s)."""
    results = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, tuning=sm90.TUNING, rows=[])
    key = jax.random.key(2)
    for B in batches:
        key, k_case = jax.random.split(key)
        args, launch = _kernel_case(k_case, B, S, H)
        f = jax.jit(functools.partial(kernel.partials, scale=SCALE, launch=launch))
        tdir = os.path.join(out_dir, f"mla trace B{B} 8K")
        os.makedirs(tdir, exist_ok=True)
        traced = jax.jit(functools.partial(kernel.partials, scale=SCALE, launch=launch, profile_dir=tdir))
        jax.block_until_ready(traced(*args))
        ctas = B * (H // launch.heads_per_group) * launch.splits
        blocks = -(-S // 64) // launch.splits  # a CTA's blocks
        nbytes = B * S * row_bytes("fp8")
        row = dict(B=B, H=H, ctx=S, launch=dict(vars(launch)), ctas=ctas, blocks_per_cta=blocks)
        row["us"], row["kernels"] = measure(f, args)
        row["floor_us"] = nbytes / HBM_PEAK * 1e6
        row["block_floor_us"] = row["floor_us"] / blocks  # every CTA streaming its blocks side by side
        row["phases"] = phases(tdir)
        results["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
        pathlib.Path(out_dir, "mla_profile.json").write_text(json.dumps(results, indent=1))
        del args


def _kernel_case(key, B, S, H):
    """The kernel's arguments at one TP16 rank's heads, equal lengths S, an fp8 cache, one query token, and
    tuning.json's launch for them -> ((q_lat, q_pe, rows, scales, lens), launch)."""
    k_cache, kq1, kq2 = jax.random.split(key, 3)
    entry = make_cache(k_cache, B, S, "fp8")
    q_lat = jax.random.normal(kq1, (B, 1, H, R), jnp.float32).astype(jnp.bfloat16)
    q_pe = (0.5 * jax.random.normal(kq2, (B, 1, H, E), jnp.float32)).astype(jnp.bfloat16)
    lens = jnp.full((B, 1), S, jnp.int32)
    return (q_lat, q_pe, entry["rows"], entry["scales"], lens), sm90.launch_for(q_lat, q_pe, entry, sm90.TUNING)


def main_once(B, S=8192, H=6):
    """The Mosaic kernel alone, called once after its compile, at one TP16 rank's heads (what ncu profiles)."""
    args, launch = _kernel_case(jax.random.key(3), B, S, H)
    f = jax.jit(functools.partial(kernel.partials, scale=SCALE, launch=launch)).lower(*args).compile()
    jax.block_until_ready(f(*args))
    print(json.dumps(dict(B=B, ctx=S, H=H, launch=dict(vars(launch)))), flush=True)


def _f(v, fmt="{:.2f}"):
    return fmt.format(v) if isinstance(v, (int, float)) else ("-" if v is None else str(v)[:40])


def markdown(results) -> str:
    lines = [
        f"# MLA decode attention, one layer, {results['cache']} latent cache, 1 query token ({results['device']}, "
        f"jax {results['jax']})",
        "",
        f"{results['measure']}. Pallas = the api's path (prep, kernel, split combine); kernel = the Mosaic kernel "
        "alone; XLA = the reference (dequantises the whole cache). Tuning: "
        f"{json.dumps(results['tuning'])}.",
        "",
        "| TP | H | B | ctx | lengths | MB valid | floor us | Pallas us | kernel us | kernel % HBM | XLA us | vs XLA "
        "| Pallas kernels | splits | rel err vs XLA |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(
            "| "
            + " | ".join(
                [
                    str(r["tp"]),
                    str(r["H"]),
                    str(r["B"]),
                    str(r["ctx"]),
                    r["lengths"],
                    _f(r["MB"]),
                    _f(r["floor_us"]),
                    _f(r["pallas_us"]),
                    _f(r.get("kernel_alone_us")),
                    _f(r.get("kernel_alone_pct_hbm"), "{:.0f}%"),
                    _f(r["xla_us"]),
                    _f(r.get("vs_xla"), "{:.2f}x"),
                    str(len(r["pallas_kernels"])),
                    str(r["launch"]["splits"]),
                    _f(r["rel_err_vs_xla"], "{:.1e}"),
                ]
            )
            + " |"
        )
    if results.get("skipped"):
        lines += ["", f"Not run (past the deadline): {results['skipped']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    args = sys.argv[1:]
    out = args[0]
    cache = args[args.index("--cache") + 1] if "--cache" in args else "fp8"
    deadline = float(args[args.index("--deadline-s") + 1]) if "--deadline-s" in args else 270.0
    if "--variants" in args:
        main_variants(out, deadline_s=deadline)
    elif "--profile" in args:
        main_profile(out)
    elif "--once" in args:
        main_once(int(args[args.index("--once") + 1]))
    else:
        main(out, quick="--quick" in args, cache=cache, deadline_s=deadline)
