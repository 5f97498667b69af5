"""KDA decode step on one GPU: correctness at real shapes, then CUPTI device time of the fused Pallas kernel
(the api path as tuning.json launches it, and the same kernel at other launch shapes), the XLA reference,
and fla's fused recurrent KDA (Triton), against the bytes the step must move; then the gate projections fused
into the kernel or run by XLA first.

  PYTHONPATH=. python3 bench/kda_decode.py OUT [FLA_JSON]   # -> OUT/kda_decode.{json,md}
      FLA_JSON: an earlier kda_decode.json whose fla numbers are reused instead of running fla again
  PYTHONPATH=. python3 bench/kda_decode.py --cold OUT       # -> OUT/kda_decode_cold.json
      the api path and XLA with a cold L2 (n distinct input sets per call, as a decode step's layers are)

The default benches repeat one call on the same inputs, so at few tiles the state stays in L2 between runs
(warm); --cold gives the in-step number.
"""

import functools
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

from bench.device_time import ITERS, device_us, kernel_names
from pallas_kernels.kda_decode import api, kernel, reference
from pallas_kernels.policy import SPECIALIZED, XLA

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
VARIANTS = [  # (v_chunk, tma staging, v_split): the stagings the kernel keeps (tma=True was removed)
    (32, False, 1),
    (128, False, 1),
    (32, "chunked", 1),
    (32, "chunked", 4),
]


def variant_name(v_chunk, tma, v_split=1, gather="gmem", warpgroups=1):
    staging = {False: "ldg", True: "tma", "chunked": "tma-chunked"}[tma]
    return (
        f"{staging} v{v_chunk}"
        + (f" split{v_split} {gather}" if v_split > 1 else "")
        + (f" wg{warpgroups}" if warpgroups > 1 else "")
    )


def variant_fn(v_chunk, tma, v_split=1, gather="gmem", warpgroups=1):
    return jax.jit(
        functools.partial(
            kernel.decode,
            eps=1e-5,
            tma=tma,
            v_split=v_split,
            gather=gather,
            warpgroups=warpgroups,
            tile_layout=kernel.plgpu.Layout.WGMMA,
            v_chunk=v_chunk,
        )
    )


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
    fused = jax.jit(lambda *a: api.kda_decode(*a, policy=SPECIALIZED))
    variants = {variant_name(*v): variant_fn(*v) for v in VARIANTS}
    results = dict(
        device=f"{dev.device_kind} (cc {dev.compute_capability})",
        jax=jax.__version__,
        hbm_peak_Bps=HBM_PEAK,
        iterations=ITERS,
        tuning=XLA.table("kda_decode"),
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


# TP16 / TP8 ranks at batch 1..64, and TP1's 96 heads: where the tuning's fuse_gates_max_batch (64) and
# fuse_gates_max_heads (12) limits come from (the fused case lifts both)
GATE_SHAPES = [(1, 6), (1, 12), (8, 6), (8, 12), (64, 6), (64, 12), (1, 96), (8, 96)]


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


def gates_cases(shapes=GATE_SHAPES):
    """The f_b and b projections (f = fa @ f_b, beta = x @ b; R = 128, D = 7168) both ways: XLA's GEMVs before
    the decode kernel, or inside it (tuning "fuse_gates_max_batch" / "fuse_gates_max_heads")."""
    from pallas_kernels.kda_decode import bodies, sm90

    rows = []
    for B, H in shapes:
        full, want = gates_inputs(B, H)
        row = dict(B=B, H=H, xla_us=device_us(jax.jit(reference.kda_decode_gates), *full))
        for fuse in (False, True):
            tuning = dict(sm90.TUNING, fuse_gates_max_batch=64 if fuse else 0, fuse_gates_max_heads=H)
            f = jax.jit(bodies.entry_points(tuning).kda_decode_gates)
            key = "fused" if fuse else "gemv+kernel"
            try:
                row[f"{key}_max_err"] = max_err(f(*full), want)
                row[f"{key}_us"] = device_us(f, *full)
                row[f"{key}_kernels"] = len(kernel_names(f, *full))
            except Exception as e:
                row[f"{key}_us"] = f"failed: {type(e).__name__}: {e}"[:300]
        print("gates", row, flush=True)
        rows.append(row)
    return rows


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
    fns = {"api": lambda *a: api.kda_decode(*a, policy=SPECIALIZED), "xla": reference.kda_decode}
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
    "--fla": main_fla,  # main runs it in its own process
}

if __name__ == "__main__":
    if sys.argv[1:2] and sys.argv[1] in MODES:
        MODES[sys.argv[1]](*sys.argv[2:3])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else ".", sys.argv[2] if len(sys.argv) > 2 else None)
