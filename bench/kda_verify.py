"""KDA speculative verify + commit on one GPU: correctness at real shapes, then CUPTI device time of the Pallas
verify and commit (the api path, as tuning.json runs them: on sm90 the commit is XLA's), of the kernels with
the state tile staged by ld/st.global or by TMA, and of the XLA reference pair, against the bytes they move.

  PYTHONPATH=. python3 bench/kda_verify.py --out OUT [--name NAME] [--cases B:H:T,...] [--iters N] [--no-check]
      [--no-variants]   -> OUT/NAME.{json,md} (NAME: kda_verify)
  --cases: those shapes instead of the full matrix; --no-variants: the api and XLA only (the ldg/tma kernels
  add four compiles per case); --no-check: no correctness pass first.

Commit accepts all T tokens (the most work per tile; the XLA commit does all T steps whatever is accepted).
"""

import argparse
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from bench.device_time import device_us, kernel_names
from pallas_kernels.kda_decode import api, reference, verify_kernel
from pallas_kernels.policy import SPECIALIZED

HBM_PEAK = 4.8e12  # H200 datasheet
SHAPES = [(B, H, T) for B in (1, 8, 64) for H in (6, 12) for T in (4, 8)]
CHECKS = [(1, 6, 8), (8, 12, 4), (64, 12, 8)]
VARIANTS = (False, True)  # tma staging of the state tile, v_chunk 32


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".", help="folder for NAME.json and NAME.md")
    p.add_argument("--name", default="kda_verify", help="the result files' name")
    p.add_argument("--iters", type=int, default=30, help="CUPTI-timed runs per case (median)")
    p.add_argument("--cases", default=None, help="B:H:T,... to time instead of the full matrix")
    p.add_argument("--no-check", action="store_true", help="skip the correctness pass at real shapes")
    p.add_argument(
        "--no-variants",
        action="store_true",
        help="time only the api and XLA paths (the tma/ldg variants add four compiles per case)",
    )
    return p.parse_args(argv)


def make_inputs(seed, B, H, T, K=128, dtype=jnp.bfloat16):
    """(verify args, accepted_B = T everywhere)."""
    r = np.random.default_rng(seed)
    act = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32).astype(dtype)  # noqa: E731
    args = (
        act(B, T, 3, H, K),
        act(B, T, H, K),
        act(B, T, H),
        act(B, T, H, K),
        jnp.asarray(r.standard_normal((B, H, K, K)) * 0.3, jnp.float32),
        act(B, 3, 3, H, K),
        jnp.asarray(r.standard_normal((3, H, K, 4)) * 0.5, jnp.float32),
        jnp.asarray(r.uniform(-1, 1.5, H), jnp.float32),
        jnp.asarray(r.standard_normal((H, K)), jnp.float32),
        jnp.asarray(1 + 0.2 * r.standard_normal(K), jnp.float32),
    )
    return args, jnp.full((B,), T, jnp.int32)


def nbytes(*trees):
    return sum(x.nbytes for x in jax.tree.leaves(trees))


def verify_bytes(args, y, data):
    """Inputs + written outputs; new_inputs is the qkv input handed through, not written."""
    return nbytes(args, y, {k: v for k, v in data.items() if k != "new_inputs_BT3HK"})


def commit_bytes(args, data, accepted, out):
    return nbytes(args[4], args[5], data, accepted, out)


def pair(verify, commit):
    """verify then commit of the same block in one jitted call: one speculative step of one layer."""

    def f(args, accepted):
        y, data = verify(*args)
        state, conv = commit(args[4], args[5], data, accepted)
        return y, state, conv

    return jax.jit(f)


def max_err(got, want):
    return float(
        max(
            jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
        )
    )


def main(opts):
    out_dir = pathlib.Path(opts.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    print(dev, dev.device_kind, dev.compute_capability, flush=True)
    ref_v, ref_c = jax.jit(reference.kda_verify), jax.jit(reference.kda_commit)
    ker_v = jax.jit(functools.partial(api.kda_verify, policy=SPECIALIZED))
    ker_c = jax.jit(functools.partial(api.kda_commit, policy=SPECIALIZED))
    ref_pair, ker_pair = pair(ref_v, ref_c), pair(ker_v, ker_c)
    layout = plgpu.Layout.WGMMA if dev.compute_capability.startswith("9") else plgpu.Layout.TCGEN05
    variants = {
        ("tma" if tma else "ldg"): (
            jax.jit(functools.partial(verify_kernel.verify, eps=1e-5, tile_layout=layout, v_chunk=32, tma=tma)),
            jax.jit(functools.partial(verify_kernel.commit, tile_layout=layout, v_chunk=32)),
        )
        for tma in ([] if opts.no_variants else VARIANTS)
    }
    results = dict(
        device=f"{dev.device_kind} (cc {dev.compute_capability})",
        jax=jax.__version__,
        hbm_peak_Bps=HBM_PEAK,
        iterations=opts.iters,
        cases=[],
        correctness=[],
    )

    # correctness of the api path at real shapes (the GPU pytest matrix checks more)
    for B, H, T in [] if opts.no_check else CHECKS:
        for dtype in (jnp.bfloat16, jnp.float32):
            args, acc = make_inputs(B * 100 + H * 10 + T, B, H, T, dtype=dtype)
            y0, d0 = ref_v(*args)
            y, d = ker_v(*args)
            errs = dict(
                y=max_err(y, y0),
                commit_data=max_err(d, d0),
                commit=max_err(ker_c(args[4], args[5], d0, acc), ref_c(args[4], args[5], d0, acc)),
            )
            results["correctness"].append(dict(B=B, H=H, T=T, dtype=jnp.dtype(dtype).name, max_abs_err=errs))
            print("check", B, H, T, jnp.dtype(dtype).name, errs, flush=True)

    shapes = [tuple(map(int, c.split(":"))) for c in opts.cases.split(",")] if opts.cases else SHAPES
    for B, H, T in shapes:
        args, acc = make_inputs(7, B, H, T)
        y, data = ref_v(*args)
        new = ref_c(args[4], args[5], data, acc)
        vb, cb = verify_bytes(args, y, data), commit_bytes(args, data, acc, new)
        case = dict(B=B, H=H, T=T, verify_bytes=vb, commit_bytes=cb, floor_us=(vb + cb) / HBM_PEAK * 1e6)
        _, kdata = ker_v(*args)
        case["pallas_verify_us"] = device_us(ker_v, *args, iters=opts.iters)
        case["pallas_commit_us"] = device_us(ker_c, args[4], args[5], kdata, acc, iters=opts.iters)
        case["pallas_us"] = device_us(ker_pair, args, acc, iters=opts.iters)
        case["pallas_kernels"] = len(kernel_names(ker_pair, args, acc))
        case["xla_verify_us"] = device_us(ref_v, *args, iters=opts.iters)
        case["xla_commit_us"] = device_us(ref_c, args[4], args[5], data, acc, iters=opts.iters)
        case["xla_us"] = device_us(ref_pair, args, acc, iters=opts.iters)
        case["xla_kernels"] = len(kernel_names(ref_pair, args, acc))
        case["variants_us"] = {}
        for name, (v, c) in variants.items():
            try:
                case["variants_us"][name] = dict(
                    verify=device_us(v, *args, iters=opts.iters),
                    commit=device_us(c, args[4], args[5], kdata, acc, iters=opts.iters),
                )
            except Exception as e:
                case["variants_us"][name] = f"failed: {type(e).__name__}: {e}"[:300]
        case["pallas_frac_of_peak"] = (vb + cb) / (case["pallas_us"] * 1e-6) / HBM_PEAK
        case["verify_frac_of_peak"] = vb / (case["pallas_verify_us"] * 1e-6) / HBM_PEAK
        case["commit_frac_of_peak"] = cb / (case["pallas_commit_us"] * 1e-6) / HBM_PEAK
        case["speedup_vs_xla"] = case["xla_us"] / case["pallas_us"]
        print(case, flush=True)
        results["cases"].append(case)
        (out_dir / f"{opts.name}.json").write_text(json.dumps(results, indent=1))  # after every case: a run
        write_table(results, out_dir / f"{opts.name}.md")  # stopped at its time limit keeps what it measured


def write_table(results, path):
    names = list(results["cases"][0]["variants_us"]) if results["cases"] else []  # none with --no-variants
    lines = [
        f"# KDA speculative verify + commit, one layer, bf16 activations, fp32 state, K=V=128 "
        f"({results['device']}, jax {results['jax']})",
        "",
        f"CUPTI device time, median of {results['iterations']}; commit accepts all T tokens; floor = "
        f"bytes / {results['hbm_peak_Bps'] / 1e12:.1f} TB/s. Pallas = api path (tuning.json launch); "
        "pair = verify then commit in one jitted call. ldg/tma: the same kernels with the state tile "
        "HBM <-> registers by ld/st.global or staged whole through SMEM by TMA (v_chunk 32).",
        "",
        "| B | H | T | MB moved | floor us | Pallas pair us (kernels) | % of peak | verify us (% peak) | "
        "commit us (% peak) | " + "".join(f"{n} v / c us | " for n in names) + "XLA pair us (kernels) | XLA v / c us | "
        "vs XLA |",
        "|---|---|---|---|---|---|---|---|---|" + "---|" * len(names) + "---|---|---|",
    ]
    for c in results["cases"]:
        var = [
            f"{v['verify']:.2f} / {v['commit']:.2f}" if isinstance(v, dict) else "x" for v in c["variants_us"].values()
        ]
        lines.append(
            f"| {c['B']} | {c['H']} | {c['T']} | {(c['verify_bytes'] + c['commit_bytes']) / 1e6:.2f} | "
            f"{c['floor_us']:.2f} | {c['pallas_us']:.2f} ({c['pallas_kernels']}) | "
            f"{100 * c['pallas_frac_of_peak']:.0f}% | "
            f"{c['pallas_verify_us']:.2f} ({100 * c['verify_frac_of_peak']:.0f}%) | "
            f"{c['pallas_commit_us']:.2f} ({100 * c['commit_frac_of_peak']:.0f}%) | {''.join(v + ' | ' for v in var)}"
            f"{c['xla_us']:.2f} ({c['xla_kernels']}) | {c['xla_verify_us']:.2f} / {c['xla_commit_us']:.2f} | "
            f"{c['speedup_vs_xla']:.2f}x |"
        )
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(parse_args())
