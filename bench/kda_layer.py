"""One whole KDA sublayer of a decode step at one tensor-parallel rank's real widths, on one GPU: projections
(q/k/v/g, f_a/f_b, b) through the state step to the o_proj partial, under decode_backend "xla" and
"latency_specialized" (as tuned: the decode GEMV, the decode kernel reading its partials, o_proj), with
kernel counts and per-kernel times. The batch has one idle slot at B > 1 (a runtime mask, as the engine runs).

  PYTHONPATH=. python3 bench/kda_layer.py OUT_DIR                  # -> OUT_DIR/kda_layer.{json,md}
  PYTHONPATH=. python3 bench/kda_layer.py OUT_DIR --cases 16:12,8:32 --name NAME   # other tp:batch pairs
  PYTHONPATH=. python3 bench/kda_layer.py OUT_DIR --name NAME \
      --gemv-launch '{"max_batch": 8, "block_k": 128, "split_k": 2, "steps": 6, "x_stream": "N"}'
      a decode-GEMV tuning entry to try: also "gemv_launch", latency_specialized with that entry (or a list of
      entries, each naming its "table" if not "launch", e.g. "o_proj_launch") first in the GEMV's tuning

Weights are the release's layer-0 KDA tensors with every tensor-parallel axis divided by tp (bench/rank_slice
local tables), random, bf16; state and conv window random. CUPTI device time, median of bench/device_time's
runs. Issue 6's reference point: a straightforward XLA layer took 38 us in 14 kernels at TP16 batch 1.
"""

import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.device_time import ITERS, device_us, kernel_names, per_kernel_us  # noqa: E402
from bench.rank_slice import init_local_params, local_cfg, truncate  # noqa: E402
from k3jax.config import preset  # noqa: E402
from k3jax.layers import kda  # noqa: E402
from pallas_kernels.policy import XLA, DecodePolicy, Tuning  # noqa: E402

# (tp, batch): 6 and 12 local heads, where the GEMV's launches change (tokens on N to 32, on M above)
CASES = [(16, 1), (16, 8), (16, 16), (16, 32), (16, 64), (8, 1), (8, 8), (8, 64)]


def layer_inputs(cfg, B, seed=0):
    """x [B, D] bf16, state [B, H, K, V] fp32, conv window [B, 3, 3, H, K] bf16: O(1) like real activations."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    x = jax.random.normal(k1, (B, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
    state = 0.3 * jax.random.normal(k2, (B, H, K, K), jnp.float32)
    window = jax.random.normal(k3, (B, 3, cfg.kda_conv_size - 1, H, K), jnp.float32).astype(jnp.bfloat16)
    return x, state, window


def gemv_entry_policy(entries) -> DecodePolicy:
    """latency_specialized with the decode GEMV's tuning holding each entry (a dict, or a list of them) before
    the launches of its "table" ("launch" unless it names "o_proj_launch"), so it serves the batches its
    min_batch and max_batch hold and the tuned launches the rest."""
    t = XLA.table("gemv")
    sm90 = dict(t["sm90"])
    for entry in entries if isinstance(entries, list) else [entries]:
        table = entry.get("table", "launch")
        sm90[table] = [entry, *sm90.get(table, [])]
    return DecodePolicy("latency_specialized", tuning=Tuning.from_files(gemv={**t, "sm90": sm90}))


def main(out_dir, cases=CASES, out_name="kda_layer", gemv_launch=None):
    dev = jax.devices()[0]
    results = dict(
        device=f"{dev.device_kind} (cc {getattr(dev, 'compute_capability', '?')})",
        jax=jax.__version__,
        what="kda.kda_decode: projections -> state step -> o_proj partial",
        measure=f"CUPTI device time per call (summed kernel time), median of {ITERS} runs",
        rows=[],
    )
    for tp in sorted({tp for tp, _ in cases}, reverse=True):
        cfg = truncate(preset("k3"), 1)  # layer 0: a KDA layer
        p = init_local_params(cfg, tp)["layers"][0]["attn"]
        lcfg = local_cfg(cfg, tp)
        for B in [b for t, b in cases if t == tp]:
            x, state, window = layer_inputs(lcfg, B)
            row = dict(tp=tp, heads=lcfg.kda_num_heads, B=B)
            active = jnp.ones((B,), jnp.int32).at[B - 1].set(0 if B > 1 else 1)
            outs = {}
            for backend in ("xla", "latency_specialized") + (("gemv_launch",) if gemv_launch else ()):
                op = gemv_entry_policy(gemv_launch) if backend == "gemv_launch" else DecodePolicy(backend)

                def f(p, x, s, w, a, c=lcfg, op=op):
                    return kda.kda_decode(p, x, c, s, w, op, active_B=a)

                f = jax.jit(f)
                args = (p, x, state, window, active)
                try:
                    outs[backend] = f(*args)
                    row[f"{backend}_us"] = device_us(f, *args)
                    row[f"{backend}_kernels"] = len(kernel_names(f, *args))
                    row[f"{backend}_per_kernel_us"] = [(n, round(t, 2)) for n, t in per_kernel_us(f, *args)]
                except Exception as e:  # noqa: BLE001  (a failure is a row entry, not the end of the run)
                    row[f"{backend}_us"] = f"failed: {type(e).__name__}: {e}"[:300]
            if gemv_launch:
                row["gemv_launch"] = gemv_launch
            for name in ("latency_specialized", "gemv_launch"):
                if name in outs and "xla" in outs:
                    live = active != 0  # an idle slot's output is not specified
                    a, b = (o[0][live].astype(jnp.float32) for o in (outs[name], outs["xla"]))
                    row[f"{name}_o_proj_rel_rms"] = float(jnp.sqrt(jnp.mean((a - b) ** 2) / jnp.mean(b**2)))
                    row[f"{name}_speedup"] = row["xla_us"] / row[f"{name}_us"]
            results["rows"].append(row)
            print(row, flush=True)
            pathlib.Path(out_dir, f"{out_name}.json").write_text(json.dumps(results, indent=1))
            write_table(results, pathlib.Path(out_dir, f"{out_name}.md"))


def write_table(results, path):
    """results (main's dict) as a markdown table: per (tp, batch) XLA and latency_specialized, kernels and speedup."""
    lines = [
        f"# One KDA sublayer of a decode step ({results['device']}, jax {results['jax']})",
        "",
        f"{results['what']}; {results['measure']}. One idle slot at B > 1. Per-kernel times in the json.",
        "",
        "| TP | local heads | B | XLA us (kernels) | latency_specialized us (kernels) | speedup |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        ls = r["latency_specialized_us"]
        if not isinstance(ls, float):
            lines.append(f"| {r['tp']} | {r['heads']} | {r['B']} | {r['xla_us']:.2f} ({r['xla_kernels']}) | {ls} | - |")
            continue
        lines.append(
            f"| {r['tp']} | {r['heads']} | {r['B']} | {r['xla_us']:.2f} ({r['xla_kernels']}) | "
            f"{ls:.2f} ({r['latency_specialized_kernels']}) | {r['xla_us'] / ls:.2f}x |"
        )
    pathlib.Path(path).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir", nargs="?", default=".")
    ap.add_argument("--cases", type=lambda s: [tuple(map(int, c.split(":"))) for c in s.split(",")], default=CASES)
    ap.add_argument("--name", default="kda_layer")
    ap.add_argument("--gemv-launch", type=json.loads, default=None)
    a = ap.parse_args()
    main(a.out_dir, a.cases, a.name, a.gemv_launch)
