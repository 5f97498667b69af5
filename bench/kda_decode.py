"""KDA decode step on one GPU: correctness at real shapes, then CUPTI device time of the fused Pallas kernel,
the XLA reference, and fla's fused recurrent KDA (Triton), against the bytes the step must move.

Run on the device machine from the repo root: PYTHONPATH=. python3 bench/kda_decode.py $OUT [FLA_JSON]
(FLA_JSON: a previous kda_decode.json whose fla numbers are reused instead of re-running fla).
`--cold OUT`: the api path and XLA with a cold L2 (main_cold), -> OUT/kda_decode_cold.json.
`--wg OUT`: the split over warpgroups of one CTA against the tuned launch (main_variants), -> OUT/kda_wg.json;
`--idle OUT`: the api launch with and without active_B (idle slots kept in the kernel) -> OUT/kda_idle.json;
`--red-scratch OUT`: the api launch with 2, 4 and 8 KiB of cross-warp reduction scratch -> OUT/kda_red_scratch.json;
`--gates-wg OUT`: the fused gates with 1 or 2 warpgroups per CTA -> OUT/kda_gates_wg.json;
`--wg-canary`: one checked call per warpgroup variant (device_queue.sh runs it under a short timeout first);
`--rows OUT`: the row-slice staging (a thread per state column) against the tuned launch -> OUT/kda_rows.json;
`--rows-canary`: one checked call per rows variant;
`--keep OUT`: the rows path with 0, 2 or 3 slices held in registers between its passes -> OUT/kda_keep.json;
`--stg OUT`: the rows path's pass 2 stored by st.global from registers, kept slices 0-3 -> OUT/kda_stg.json;
`--gates OUT`: the gate projections fused or by XLA, with b out-major (table version 4) ->
OUT/kda_gates_out_major.json; `--gates96 OUT`: the same at 96 heads (TP1) -> OUT/kda_gates_96.json.
Writes kda_decode.json and kda_decode.md into the given folder.
"""

import functools
import itertools
import json
import os
import pathlib
import subprocess
import sys
import traceback
import types

import jax
import jax.numpy as jnp
import numpy as np

from bench.device_time import ITERS, device_us, kernel_names, time_variants
from pallas_kernels.kda_decode import api, kernel, reference

HBM_PEAK = 4.8e12  # H200 datasheet
SHAPES = [(1, 6), (1, 12), (1, 96), (8, 6), (8, 12), (8, 96), (64, 6), (64, 12), (64, 96)]


def make_inputs(seed, B, H, K=128, dtype=jnp.bfloat16):
    r = np.random.default_rng(seed)
    act = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32).astype(dtype)  # noqa: E731
    return (
        act(B, 3, H, K),
        act(B, H, K),
        act(B, H),
        act(B, H, K),
        jnp.asarray(r.standard_normal((B, H, K, K)) * 0.3, jnp.float32),
        act(B, 3, 3, H, K),
        jnp.asarray(r.standard_normal((3, H, K, 4)) * 0.5, jnp.float32),
        jnp.asarray(r.uniform(-1, 1.5, H), jnp.float32),
        jnp.asarray(r.standard_normal((H, K)), jnp.float32),
        jnp.asarray(1 + 0.2 * r.standard_normal(K), jnp.float32),
    )


def step_bytes(args, outs):
    return sum(a.nbytes for a in args) + sum(o.nbytes for o in outs)


def load_fla():
    """fla's three decode kernels for a KDA layer (its layers/kda.py at T = 1): the short-conv update, the fused
    recurrence, the gated RMSNorm. fla is pure Python on top of Triton; its package __init__s import every op
    and model, so they are skipped."""
    source = "installed"
    try:
        import fla  # noqa: F401
    except Exception:
        source = "carried wheel source (bench/build/fla_src)"
        root = pathlib.Path("bench/build/fla_src")
        sys.path.insert(0, str(root))
        for name in ("fla", "fla.ops", "fla.ops.kda", "fla.modules", "fla.modules.conv", "fla.modules.conv.triton"):
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(root / name.replace(".", "/"))]
            pkg.__version__ = "0.5.2"  # fla.utils reads it from the package
            sys.modules[name] = pkg
    from fla.modules.conv.triton.kernels import causal_conv1d_update
    from fla.modules.fused_norm_gate import layer_norm_gated_fwd
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    return types.SimpleNamespace(
        recurrent=fused_recurrent_kda_fwd, conv_update=causal_conv1d_update, gated_norm=layer_norm_gated_fwd
    ), source


def torch_device_us(run):
    """Device time per call of run() by torch's profiler (CUPTI): the sum of its kernels, launch gaps
    excluded."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            run()
        torch.cuda.synchronize()
    return (
        sum(
            e.device_time_total
            for e in prof.key_averages()
            if e.device_time_total > 0 and e.key != "ProfilerStep*" and "Memcpy" not in e.key
        )
        / ITERS
    )


def fla_case(fla, args):
    """fla at T = 1, two ways, each checked against our reference first:
    - recurrence only (fla_us): fused_recurrent_kda with gate, beta sigmoid and L2 norms in-kernel, state
      updated in place, from post-conv q, k, v. Less work than our kernel: no conv, no gated norm.
    - the same work as our kernel (fla_full_us): what fla's KDA layer runs after its projections at decode, the
      short-conv update for q, k and v (three launches, windows in place), the recurrence, the gated RMSNorm
      with the sigmoid gate."""
    import torch

    qkv, f, beta, gate, state, conv, conv_w, A_log, dt_bias, o_norm_w = args
    B, _, H, K = qkv.shape
    qn, kn, v, decay, beta_s, _ = reference.prepare(qkv, f, beta, conv, conv_w, A_log, dt_bias)
    # post-conv q, k, v in bf16 as fla's recurrence receives them (it normalises them itself)
    window = jnp.concatenate([conv, qkv[:, :, None]], axis=2).astype(jnp.float32)
    y = jnp.sum(window * jnp.moveaxis(conv_w, -1, 1)[None], axis=2)
    post = (y * jax.nn.sigmoid(y)).astype(jnp.bfloat16)
    t = lambda a: torch.from_dlpack(a).contiguous()  # noqa: E731
    q_t, k_t, v_t = (t(post[:, i][:, None]) for i in range(3))
    g_t, b_t = t(f[:, None]), t(beta[:, None])
    h0 = t(state).clone()
    A_t, dtb_t = t(A_log), t(dt_bias.reshape(-1))

    def recurrence(q, k, v, h):
        return fla.recurrent(
            q,
            k,
            v,
            g_t,
            b_t,
            A_log=A_t,
            dt_bias=dtb_t,
            initial_state=h,
            output_final_state=True,
            inplace_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            lower_bound=-5.0,
        )

    want_state = reference.advance(
        state, kn, decay, beta_s, v - jnp.sum(decay[..., None] * state * kn[..., None], axis=-2)
    )
    _, ht = recurrence(q_t, k_t, v_t, h0)
    torch.cuda.synchronize()
    res = dict(fla_state_err=float(jnp.max(jnp.abs(jnp.asarray(ht.cpu().numpy()) - want_state))))
    res["fla_us"] = torch_device_us(lambda: recurrence(q_t, k_t, v_t, h0))

    # the same work: pre-conv inputs, fla's window layout [B, D, W] (slot 0 is shifted out: random here)
    D = H * K
    x_t = [t(qkv[:, i].reshape(B, 1, D)) for i in range(3)]
    cache0 = jnp.concatenate(
        [jnp.ones((B, 3, D, 1), conv.dtype) * 7, jnp.moveaxis(conv.reshape(B, 3, 3, D), 2, -1)], axis=-1
    )  # [B, 3, D, W]
    caches = [t(cache0[:, i]) for i in range(3)]
    w_t = [t(conv_w[i].reshape(D, 4)) for i in range(3)]  # fp32 taps, as ours
    gate_t, onw_t = t(gate.reshape(B * H, K)), t(o_norm_w)
    h1 = t(state).clone()

    def full():
        qkv_post = [fla.conv_update(x_t[i], caches[i], weight=w_t[i], activation="silu")[0] for i in range(3)]
        q, k, v = (a.view(B, 1, H, K) for a in qkv_post)
        o, _ = recurrence(q, k, v, h1)
        return fla.gated_norm(o.view(B * H, K), gate_t, onw_t, None, activation="sigmoid", eps=1e-5, is_rms_norm=True)[
            0
        ]

    y_t = full()
    torch.cuda.synchronize()
    y_want = jax.jit(reference.kda_decode)(*args)[0]
    res["fla_full_y_err"] = float(
        jnp.max(jnp.abs(jnp.asarray(y_t.float().cpu().numpy()).reshape(B, H, K) - y_want.astype(jnp.float32)))
    )
    res["fla_full_us"] = torch_device_us(full)
    return res


# Same kernel, other launch shapes: (v_chunk, tma, v_split). The api row is whatever tuning.json picks.
# tma "chunked": one TMA load and store per v_chunk slice instead of one per tile; v_split: CTAs per tile
# (a cluster), with o gathered for the gated norm through GMEM or CTA 0's SMEM (gather, optional 4th entry).
VARIANTS = [
    (32, False, 1),
    (128, False, 1),
    (32, True, 1),
    (64, True, 1),
    (128, True, 1),
    (32, "chunked", 1),
    (32, "chunked", 4),
]
# The cluster split of V against the api path where one CTA's serial chain is the time (<= 1 wave of tiles).
SPLIT_VARIANTS = [
    (32, "chunked", 4),
    (32, False, 4),
    (32, True, 4),
    (64, True, 2),
    (32, "chunked", 4, "dsmem"),
    (32, False, 4, "dsmem"),
    (32, True, 4, "dsmem"),
]
# At ~2 waves of tiles (768) smaller CTAs may keep more bytes in flight per SM (a 32 KiB TMA slice: up to 7 CTAs
# per SM by SMEM instead of 3; fla runs 4 CTAs of 32 columns per head at every batch): the bandwidth
# question, asked after the latency rows.
SPLIT_BANDWIDTH_VARIANTS = [(64, True, 2), (32, True, 2), (32, False, 4), (32, True, 4)]


def variant_name(v_chunk, tma, v_split=1, gather="gmem", warpgroups=1):
    if tma == "rows":  # v_chunk is the rows per slice here (k_chunk)
        return f"rows k{v_chunk}"
    staging = {False: "ldg", True: "tma", "chunked": "tma-chunked"}[tma]
    return (
        f"{staging} v{v_chunk}"
        + (f" split{v_split} {gather}" if v_split > 1 else "")
        + (f" wg{warpgroups}" if warpgroups > 1 else "")
    )


def variant_fn(v_chunk, tma, v_split=1, gather="gmem", warpgroups=1):
    chunks = dict(k_chunk=v_chunk) if tma == "rows" else dict(v_chunk=v_chunk)
    return jax.jit(
        functools.partial(
            kernel.decode,
            eps=1e-5,
            tma=tma,
            v_split=v_split,
            gather=gather,
            warpgroups=warpgroups,
            tile_layout=kernel.plgpu.Layout.WGMMA,
            **chunks,
        )
    )


# The tile's columns split over the warpgroups of one CTA (no cluster: o meets in WG 0's SMEM behind a CTA
# barrier), against the tuned launch, at every tile count where one CTA's serial chain or the tail matters.
WG_VARIANTS = [
    (32, "chunked", 1, "gmem", 2),
    (32, "chunked", 1, "gmem", 4),
    (32, False, 1, "gmem", 2),
    (32, False, 1, "gmem", 4),
    (32, "chunked", 4, "dsmem"),
]
WG_SHAPES = [(1, 6), (1, 12), (8, 6), (8, 12), (1, 96), (2, 96), (64, 6), (64, 12), (8, 96)]


def main_variants(out_dir, variants=WG_VARIANTS, shapes=WG_SHAPES, name="kda_wg", extra=None):
    """variants (and extra: {name: jitted fn}) against the api path and XLA at shapes, CUPTI. Writes
    OUT/<name>.json."""
    ref = jax.jit(reference.kda_decode)
    fns = {
        "api": jax.jit(lambda *a: api.kda_decode(*a, backend="latency_specialized")),
        "xla": ref,
        **{variant_name(*v): variant_fn(*v) for v in variants},
        **(extra or {}),
    }
    dev = jax.devices()[0]
    results = dict(
        device=f"{dev.device_kind} (cc {dev.compute_capability})",
        jax=jax.__version__,
        measure=f"CUPTI device time per call, median of {ITERS} runs",
        tuning=api_tuning(),
        rows=[],
    )
    for B, H in shapes:
        args = make_inputs(7, B, H)
        want = ref(*args)
        row = dict(
            B=B, H=H, floor_us=step_bytes(args, want) / HBM_PEAK * 1e6, **time_variants(fns, args, want, max_err)
        )
        results["rows"].append(row)
        print({k: v for k, v in row.items() if not k.endswith("_max_err")}, flush=True)
        pathlib.Path(out_dir, f"{name}.json").write_text(json.dumps(results, indent=1))


# Thread t owning state column t, the tile staged in row slices of k rows (kernel._recurrence_rows): the
# K-reductions inside each thread, no per-slice cross-warp barriers, against the tuned launch at every size.
ROWS_VARIANTS = [(32, "rows"), (16, "rows"), (64, "rows")]
ROWS_SHAPES = [(1, 6), (8, 12), (1, 96), (2, 96), (64, 6), (64, 12), (8, 96), (64, 96)]


def rows_fn(**kw):
    """kernel.decode with the rows staging (32-row slices) and kw."""
    return jax.jit(
        functools.partial(kernel.decode, eps=1e-5, tma="rows", k_chunk=32, tile_layout=kernel.plgpu.Layout.WGMMA, **kw)
    )


# How many 32-row slices stay in registers between the rows path's two passes (kernel keep_slices): fewer
# SMEM rereads against more registers (~32 per slice). Measured (kda_keep.json, eleventh session): 1 and 2
# gain, 4 (191 registers: 2 CTAs per SM, not 3) loses; 3 is the last that may keep 3 CTAs per SM (<= 170).
KEEP_VARIANTS = {f"rows keep{k}": rows_fn(keep_slices=k) for k in (0, 2, 3)}
# Pass 2's rows stored straight from registers (row_stores="global") instead of SMEM + TMA: if the SMEM traffic
# keep removed is what costs, this removes more (two of a tile's five SMEM passes).
STG_VARIANTS = {f"rows keep{k}": rows_fn(keep_slices=k) for k in (2, 3)} | {
    f"rows keep{k} st.global": rows_fn(keep_slices=k, row_stores="global") for k in (0, 2, 3)
}
KEEP_SHAPES = [(64, 6), (64, 12), (8, 96), (64, 96)]


def main_rows_canary():
    """One checked decode per rows variant at 64 x 6 (device_queue.sh runs it under a short timeout first)."""
    args = make_inputs(7, 64, 6)
    want = jax.jit(reference.kda_decode)(*args)
    ok = True
    for v in ROWS_VARIANTS:
        err = max_err(variant_fn(*v)(*args), want)
        good = all(e < 0.05 for e in err.values())
        ok &= good
        print(variant_name(*v), err, "OK" if good else "WRONG", flush=True)
    sys.exit(0 if ok else 1)


def main_red_scratch(out_dir, sizes=(2048, 4096, 8192)):
    """The api launch with each size of Mosaic GPU's cross-warp reduction scratch (bytes per warpgroup): a
    [K, 32] chunk's column sums need 4 x 1 KiB, so with 2 KiB each reduction runs in two rounds of two
    warpgroup barriers. Fresh jits per size (the size is read at trace time). Writes OUT/kda_red_scratch.json."""
    import dataclasses

    from pallas_kernels.kda_decode import bodies, sm90

    ref = jax.jit(reference.kda_decode)
    dev = jax.devices()[0]
    results = dict(
        device=f"{dev.device_kind} (cc {dev.compute_capability})",
        jax=jax.__version__,
        measure=f"CUPTI device time per call, median of {ITERS} runs",
        rows=[],
    )
    lane = kernel.LANE_PARAMS
    for B, H in [(1, 6), (8, 12), (64, 6), (64, 12)]:
        args = make_inputs(7, B, H)
        want = ref(*args)
        fns = {}
        for size in sizes:
            kernel.LANE_PARAMS = dataclasses.replace(lane, reduction_scratch_bytes=size)
            kernel.RED_SCRATCH = size // 4
            launch = kernel.pick_launch(sm90.TUNING, args[0])
            f = jax.jit(functools.partial(kernel.decode.__wrapped__, eps=1e-5, **bodies.kernel_launch(launch, None)))
            fns[f"scratch {size}"] = f
            jax.block_until_ready(f(*args))  # traced now, with this size
        kernel.LANE_PARAMS = lane
        row = dict(B=B, H=H, **time_variants(fns, args, want, max_err))
        results["rows"].append(row)
        print({k: v for k, v in row.items() if not k.endswith("_max_err")}, flush=True)
        pathlib.Path(out_dir, "kda_red_scratch.json").write_text(json.dumps(results, indent=1))


def main_idle(out_dir):
    """The api launch without active_B (no mask input, no branches) and with it (one idle sequence where B > 1):
    what keeping idle slots in the kernel costs, CUPTI. Writes OUT/kda_idle.json."""
    from pallas_kernels.kda_decode import bodies, sm90

    api_fn, ref = jax.jit(bodies.entry_points(sm90.TUNING).kda_decode), jax.jit(reference.kda_decode)
    dev = jax.devices()[0]
    results = dict(
        device=f"{dev.device_kind} (cc {dev.compute_capability})",
        jax=jax.__version__,
        measure=f"CUPTI device time per call, median of {ITERS} runs",
        tuning=api_tuning(),
        rows=[],
    )
    for B, H in [(1, 6), (8, 6), (8, 12), (1, 96), (64, 6), (64, 12), (8, 96)]:
        args = make_inputs(7, B, H)
        active = jnp.ones((B,), jnp.int32).at[B - 1].set(0 if B > 1 else 1)
        row = dict(
            B=B,
            H=H,
            **time_variants({"no mask": api_fn}, args, ref(*args), max_err),
            **time_variants({"mask": api_fn}, (*args, active), ref(*args, active), max_err),
        )
        results["rows"].append(row)
        print({k: v for k, v in row.items() if not k.endswith("_max_err")}, flush=True)
        pathlib.Path(out_dir, "kda_idle.json").write_text(json.dumps(results, indent=1))


def main_wg_canary():
    """One decode per warpgroup variant at 1 x 6 against the reference, run under a short timeout before the
    GPU tests: a hang (a barrier miscount) costs a minute, not the call. Exit status 0 only if all matched."""
    args = make_inputs(7, 1, 6)
    want = jax.jit(reference.kda_decode)(*args)
    ok = True
    for v in WG_VARIANTS[:4]:
        err = max_err(variant_fn(*v)(*args), want)
        good = all(e < 0.05 for e in err.values())
        ok &= good
        print(variant_name(*v), err, "OK" if good else "WRONG", flush=True)
    sys.exit(0 if ok else 1)


def max_err(got, want):
    return {
        n: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        for n, a, b in zip(("y", "state", "conv"), got, want, strict=True)
    }


def main(out_dir, fla_from=None):
    """fla_from: a previous kda_decode.json whose fla numbers are reused instead of re-running fla."""
    out_dir = pathlib.Path(out_dir)
    dev = jax.devices()[0]
    print(dev, dev.device_kind, dev.compute_capability)
    ref = jax.jit(reference.kda_decode)
    fused = jax.jit(lambda *a: api.kda_decode(*a, backend="latency_specialized"))
    variants = {variant_name(*v): variant_fn(*v) for v in VARIANTS}
    results = dict(
        device=f"{dev.device_kind} (cc {dev.compute_capability})",
        jax=jax.__version__,
        hbm_peak_Bps=HBM_PEAK,
        iterations=ITERS,
        tuning=api_tuning(),
        cases=[],
        correctness=[],
    )

    # correctness of the api path at real shapes, both dtypes (every variant is checked per timed case below)
    for B, H in [(1, 6), (8, 12), (64, 6), (2, 96)]:
        for dtype in (jnp.bfloat16, jnp.float32):
            args = make_inputs(B * 1000 + H, B, H, dtype=dtype)
            want, got = ref(*args), fused(*args)
            errs = max_err(got, want)
            rel_state = errs["state"] / float(jnp.max(jnp.abs(want[1])))
            results["correctness"].append(
                dict(B=B, H=H, dtype=jnp.dtype(dtype).name, max_abs_err=errs, state_rel_err=rel_state)
            )
            print("check", B, H, jnp.dtype(dtype).name, errs, rel_state, flush=True)

    # XLA copy of a large buffer: the practical bandwidth ceiling on this machine
    big = jnp.ones((256 * 2**20,), jnp.float32)
    copy_us = device_us(jax.jit(lambda x: x + 1), big)
    results["xla_copy_1GiB_read_write_Bps"] = 2 * big.nbytes / (copy_us * 1e-6)
    print("copy bandwidth", results["xla_copy_1GiB_read_write_Bps"] / 1e12, "TB/s", flush=True)

    for B, H in SHAPES:
        args = make_inputs(7, B, H)
        want = ref(*args)
        nbytes = step_bytes(args, want)
        case = dict(B=B, H=H, bytes=nbytes, floor_us=nbytes / HBM_PEAK * 1e6)
        case["pallas_us"] = device_us(fused, *args)
        # the state alone, read and written once by an XLA elementwise kernel: what moving these bytes costs
        # on this machine at this size (a launch, the ramp, DRAM read/write turnaround), no maths
        case["state_copy_us"] = device_us(jax.jit(lambda s: s + 1.0), args[4])
        case["xla_us"] = device_us(ref, *args)
        case["xla_kernels"] = len(kernel_names(ref, *args))
        case["pallas_kernels"] = len(kernel_names(fused, *args))
        case["variants_us"], case["variants_max_err"] = {}, {}
        for name, f in variants.items():
            try:
                case["variants_max_err"][name] = max_err(f(*args), want)
                case["variants_us"][name] = device_us(f, *args)
            except Exception as e:
                case["variants_us"][name] = f"failed: {type(e).__name__}: {e}"[:300]
        case["pallas_frac_of_peak"] = nbytes / (case["pallas_us"] * 1e-6) / HBM_PEAK
        case["speedup_vs_xla"] = case["xla_us"] / case["pallas_us"]
        print(case, flush=True)
        results["cases"].append(case)

    results["gates"] = gates_cases()
    if fla_from:
        old = {f"{c['B']}x{c['H']}": c for c in json.loads(pathlib.Path(fla_from).read_text())["cases"]}
        results["fla"] = f"reused from {fla_from} (same machine kind, same shapes)"
        fla = {k: {n: v for n, v in c.items() if n.startswith("fla")} for k, c in old.items()}
    else:
        # fla in its own process: torch's profiler and the Mosaic GPU profiler cannot both hold CUPTI.
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        subprocess.run([sys.executable, __file__, "--fla", str(out_dir)], env=env, timeout=200, check=False)
        fla_path = out_dir / "fla.json"
        fla = json.loads(fla_path.read_text()) if fla_path.exists() else {"source": "failed to run"}
        results["fla"] = fla.pop("source")
    for case in results["cases"]:
        case.update(fla.get(f"{case['B']}x{case['H']}", {}))
    (out_dir / "kda_decode.json").write_text(json.dumps(results, indent=1))
    write_table(results, out_dir / "kda_decode.md")


GATE_SHAPES = [(1, 6), (1, 12), (8, 12), (64, 12)]  # TP16 / TP8 ranks at batch 1..64


def gates_inputs(B, H):
    """kda_decode_gates' inputs (fa, f_b, x, b in place of f, beta; R = 128, D = 7168) and the reference's
    outputs on them."""
    args = list(make_inputs(11, B, H))
    r = np.random.default_rng(B * 100 + H)
    gate_in = [
        jnp.asarray(r.standard_normal(shape) * scale, jnp.bfloat16)
        for shape, scale in (((B, 128), 1.0), ((128, H, 128), 128**-0.5), ((B, 7168), 1.0), ((H, 7168), 7168**-0.5))
    ]
    full = [args[0], *gate_in, *args[3:]]
    return full, jax.jit(reference.kda_decode_gates)(*full)


# b out-major [H, D] (weight table version 4): do the fused gates' limits (batch 8, 12 heads) still hold?
GATE_SHAPES_OUT_MAJOR = GATE_SHAPES + [(8, 6), (64, 6), (1, 96), (8, 96)]
# (the twelfth session's run of those kept the tuned 12-head limit, so its 96-head rows ran unfused both ways;
# the fused case now lifts both limits.) TP1's widths alone:
GATE_SHAPES_96 = [(1, 96), (8, 96), (64, 96)]


def gates_cases(warpgroups=(None,), shapes=GATE_SHAPES):
    """Issue 6 stretch goal, both ways: the f_b and b projections (f = fa @ f_b, beta = x @ b; R = 128,
    D = 7168) as XLA GEMVs before the decode kernel, or inside it (tuning "fuse_gates_max_batch").
    warpgroups: also with every launch entry forced to that many warpgroups per CTA (None: as tuned)."""
    from pallas_kernels.kda_decode import bodies, sm90

    rows = []
    for B, H in shapes:
        full, want = gates_inputs(B, H)
        row = dict(B=B, H=H, xla_us=device_us(jax.jit(reference.kda_decode_gates), *full))
        for fuse, wg in itertools.product((False, True), warpgroups):
            tuning = dict(sm90.TUNING, fuse_gates_max_batch=64 if fuse else 0, fuse_gates_max_heads=H)
            if wg is not None:
                tuning["launch"] = [dict(e, warpgroups=wg, v_split=1) for e in tuning["launch"]]
            f = jax.jit(bodies.entry_points(tuning).kda_decode_gates)
            key = ("fused" if fuse else "gemv+kernel") + ("" if wg is None else f" wg{wg}")
            try:
                row[f"{key}_max_err"] = max_err(f(*full), want)
                row[f"{key}_us"] = device_us(f, *full)
                row[f"{key}_kernels"] = len(kernel_names(f, *full))
            except Exception as e:
                row[f"{key}_us"] = f"failed: {type(e).__name__}: {e}"[:300]
        print("gates", row, flush=True)
        rows.append(row)
    return rows


def write_gates(out_dir, name, rows):
    """gates_cases' rows with the machine, jax version and method, -> OUT/<name>.json."""
    dev = jax.devices()[0]
    results = dict(
        device=f"{dev.device_kind} (cc {dev.compute_capability})",
        jax=jax.__version__,
        measure=f"CUPTI device time per call, median of {ITERS} runs",
        rows=rows,
    )
    pathlib.Path(out_dir, f"{name}.json").write_text(json.dumps(results, indent=1))


def api_tuning():
    return json.loads((pathlib.Path(kernel.__file__).parent / "tuning.json").read_text())


def write_table(results, path):
    names = list(results["cases"][0]["variants_us"])
    lines = [
        f"# KDA decode step, one layer, bf16 activations, fp32 state, K=V=128 "
        f"({results['device']}, jax {results['jax']})",
        "",
        f"CUPTI device time, median of {results['iterations']}; floor = bytes / "
        f"{results['hbm_peak_Bps'] / 1e12:.1f} TB/s. "
        f"XLA x+1 copy reaches {results['xla_copy_1GiB_read_write_Bps'] / 1e12:.2f} TB/s. "
        f"fla: {results['fla']}. fla us: its fused recurrence alone (gate, beta, L2 in-kernel: no conv, no "
        "gated norm); fla same-work us: what fla's KDA layer runs at decode for the work our one kernel does "
        "(3 short-conv updates + the recurrence + the gated RMSNorm, 5 launches). state copy us: XLA's "
        "s + 1 over the state alone, the cost of moving its bytes at this size.",
        "",
        f"Pallas = the api path (tuning.json sm90: {results['tuning']['sm90']}). Variant columns = the same "
        "kernel, other launch shapes: ldg = state HBM <-> registers by ld/st.global in vN column chunks, "
        "tma = whole tile staged through swizzled SMEM by TMA, processed in vN chunks.",
        "",
        "| B | H | MB moved | floor us | Pallas us | % of peak | "
        + " | ".join(names)
        + " | state copy us | XLA us (kernels) | vs XLA | fla us | vs fla | fla same-work us | vs fla same-work |",
        "|---|---|---|---|---|---|" + "---|" * len(names) + "---|---|---|---|---|---|---|",
    ]
    for c in results["cases"]:
        fla, full = (_fla_cols(c.get(k), c["pallas_us"]) for k in ("fla_us", "fla_full_us"))
        copy = c.get("state_copy_us")
        copy = f"{copy:.2f}" if isinstance(copy, float) else "-"
        var = " | ".join(f"{v:.2f}" if isinstance(v, float) else "x" for v in c["variants_us"].values())
        lines.append(
            f"| {c['B']} | {c['H']} | {c['bytes'] / 1e6:.2f} | {c['floor_us']:.2f} | "
            f"{c['pallas_us']:.2f} | {100 * c['pallas_frac_of_peak']:.0f}% | {var} | "
            f"{copy} | {c['xla_us']:.2f} ({c['xla_kernels']}) | {c['speedup_vs_xla']:.2f}x | "
            f"{fla} | {full} |"
        )
    if results.get("gates"):
        lines += [
            "",
            "f_b and b projections (R = 128, D = 7168, bf16): XLA GEMVs then the kernel, or fused into "
            "it (tuning fuse_gates); XLA = the reference (projections + step).",
            "",
            "| B | H | XLA us | GEMVs + kernel us (kernels) | fused us (kernels) |",
            "|---|---|---|---|---|",
        ]
        fmt = lambda row, k: (
            f"{row[k + '_us']:.2f} ({row[k + '_kernels']})"  # noqa: E731
            if isinstance(row.get(k + "_us"), float)
            else "x"
        )
        for g in results["gates"]:
            lines.append(f"| {g['B']} | {g['H']} | {g['xla_us']:.2f} | {fmt(g, 'gemv+kernel')} | {fmt(g, 'fused')} |")
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _fla_cols(us, ours):
    """'us | ours' speedup' for a markdown row, dashes where fla did not run."""
    return f"{us:.2f} | {us / ours:.2f}x" if isinstance(us, float) else "- | -"


def main_fla(out_dir):
    res = {}
    try:
        fla, res["source"] = load_fla()
    except Exception as e:
        res["source"] = f"unavailable: {e!r}"
        traceback.print_exc()
    else:
        for B, H in SHAPES:
            try:
                res[f"{B}x{H}"] = fla_case(fla, make_inputs(7, B, H))
            except Exception as e:
                res[f"{B}x{H}"] = dict(fla_us=f"failed: {e!r}"[:300])
                traceback.print_exc()
            print("fla", B, H, res[f"{B}x{H}"], flush=True)
    (pathlib.Path(out_dir) / "fla.json").write_text(json.dumps(res, indent=1))


def main_regs():
    """Compile every variant once; run with MOSAIC_GPU_DUMP_PTXAS=1 to get ptxas register/spill counts."""
    args = make_inputs(7, 8, 12)
    for v in VARIANTS:
        print("=== variant", variant_name(*v), flush=True)
        jax.block_until_ready(variant_fn(*v)(*args))


def main_split_canary(gather):
    """One 4-CTA-cluster decode per staging with this gather at B 1 x H 6, checked against the reference: run
    under a short timeout before the split's tests and benches, so a hang (a barrier miscount) costs a minute
    of device time, not the whole call. Exit status 0 only if every staging matched."""
    args = make_inputs(7, 1, 6)
    want = jax.jit(reference.kda_decode)(*args)
    ok = True
    for v in SPLIT_VARIANTS:
        if v[2] == 4 and _gather(v) == gather:
            err = max_err(variant_fn(*v)(*args), want)
            good = all(e < 0.05 for e in err.values())  # bf16 outputs: a wrong gather is off by O(1)
            ok &= good
            print(variant_name(*v), err, "OK" if good else "WRONG", flush=True)
    sys.exit(0 if ok else 1)


def _gather(v):
    return v[3] if len(v) > 3 else "gmem"


def split_gathers():
    """The gathers the canary passed on this machine (K3JAX_SPLIT_GATHERS, set by device_queue.sh), or both."""
    return os.environ.get("K3JAX_SPLIT_GATHERS", "gmem dsmem").split()


def main_split(out_dir):
    """The cluster split of V (SPLIT_VARIANTS) against the api path and the XLA reference at the tile counts
    where one CTA's serial chain is the time, CUPTI: a short GPU call. Writes OUT/kda_split.json.
    (The chunked-TMA quick run of the fourth session is results/kda_chunked.json.)"""
    ref = jax.jit(reference.kda_decode)
    base = {"api": jax.jit(lambda *a: api.kda_decode(*a, backend="latency_specialized")), "xla": ref}
    ok = split_gathers()
    latency = dict(base, **{variant_name(*v): variant_fn(*v) for v in SPLIT_VARIANTS if _gather(v) in ok})
    bandwidth = dict(base, **{variant_name(*v): variant_fn(*v) for v in SPLIT_BANDWIDTH_VARIANTS if _gather(v) in ok})
    dev = jax.devices()[0]
    results = dict(
        device=f"{dev.device_kind} (cc {dev.compute_capability})",
        jax=jax.__version__,
        measure=f"CUPTI device time per call, median of {ITERS} runs",
        tuning=api_tuning(),
        rows=[],
    )
    # 64 x 6: 384 tiles, where fla (4 CTAs per head) led most (15.8 vs 21.2 us); 64 x 12: 768 tiles, ~2 waves
    for B, H, fns in [
        (1, 6, latency),
        (1, 12, latency),
        (8, 12, latency),
        (2, 96, latency),
        (64, 6, bandwidth),
        (64, 12, bandwidth),
    ]:
        args = make_inputs(7, B, H)
        want = ref(*args)
        row = dict(
            B=B, H=H, floor_us=step_bytes(args, want) / HBM_PEAK * 1e6, **time_variants(fns, args, want, max_err)
        )
        results["rows"].append(row)
        print(row, flush=True)
        pathlib.Path(out_dir, "kda_split.json").write_text(json.dumps(results, indent=1))


COLD_BYTES = 160 * 2**20  # > the H200's 50 MB L2 three times over: a copy's data is evicted before its turn


def cold_fn(f):
    """f over a list of n distinct input sets in one jitted call, unrolled (no scan: its stacked outputs would
    add copy kernels): set i's state and weights were last touched n - 1 calls ago, as a decode step's layer's
    are."""
    return jax.jit(lambda sets: [f(*a) for a in sets])


def main_cold(out_dir, shapes=SHAPES):
    """The api path (tuning.json's launch) and the XLA reference with a cold L2: per call, CUPTI device time of
    n calls on n distinct input sets / n. The default benches repeat one call on the same inputs, which keeps
    a small step's state (0.9 MB at 1 x 6) in L2. Writes OUT/kda_decode_cold.json."""
    fns = {"api": lambda *a: api.kda_decode(*a, backend="latency_specialized"), "xla": reference.kda_decode}
    dev = jax.devices()[0]
    results = dict(
        device=f"{dev.device_kind} (cc {getattr(dev, 'compute_capability', '?')})",
        jax=jax.__version__,
        cold_bytes=COLD_BYTES,
        rows=[],
    )
    for B, H in shapes:
        one = make_inputs(0, B, H)
        n = max(1, min(256, -(-COLD_BYTES // sum(a.nbytes for a in one))))
        sets = [make_inputs(i, B, H) for i in range(n)]
        row = dict(B=B, H=H, sets=n)
        for name, f in fns.items():
            g = cold_fn(f)
            row[f"{name}_cold_us"] = device_us(g, sets) / n
            row[f"{name}_warm_us"] = device_us(jax.jit(f), *one)
        results["rows"].append(row)
        print(row, flush=True)
        pathlib.Path(out_dir, "kda_decode_cold.json").write_text(json.dumps(results, indent=1))


MODES = {  # flag -> what it runs with the flag's argument (see the module docstring)
    "--cold": main_cold,
    "--split": main_split,
    "--split-canary": main_split_canary,
    "--wg": main_variants,
    "--idle": main_idle,
    "--red-scratch": main_red_scratch,
    "--fla": main_fla,
    "--gates-wg": lambda out: write_gates(out, "kda_gates_wg", gates_cases(warpgroups=(1, 2))),
    "--wg-canary": lambda: main_wg_canary(),
    "--regs": lambda: main_regs(),
    "--rows": lambda out: main_variants(out, ROWS_VARIANTS, ROWS_SHAPES, "kda_rows"),
    "--rows-canary": lambda: main_rows_canary(),
    "--keep": lambda out: main_variants(out, (), KEEP_SHAPES, "kda_keep", extra=KEEP_VARIANTS),
    "--stg": lambda out: main_variants(out, (), KEEP_SHAPES, "kda_stg", extra=STG_VARIANTS),
    "--gates": lambda out: write_gates(out, "kda_gates_out_major", gates_cases(shapes=GATE_SHAPES_OUT_MAJOR)),
    "--gates96": lambda out: write_gates(out, "kda_gates_96", gates_cases(shapes=GATE_SHAPES_96)),
}

if __name__ == "__main__":
    if sys.argv[1:2] and sys.argv[1] in MODES:
        MODES[sys.argv[1]](*sys.argv[2:3])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else ".", sys.argv[2] if len(sys.argv) > 2 else None)
