"""One whole KDA sublayer of a decode step at one tensor-parallel rank's real widths, on one GPU: projections
(q/k/v/g, f_a/f_b, b) through the state step to the o_proj partial, under decode_backend "xla" and
"latency_specialized". Issue 6 asks to count the whole layer, not only the recurrence: its reference point is
a straightforward XLA layer at 38 us in 14 kernels at batch 1 (TP16).

  PYTHONPATH=. python3 bench/kda_layer.py OUT_DIR        (GPU; writes OUT_DIR/kda_layer.json)

Backends: xla, latency_specialized (as tuned), and "gemv": latency_specialized with the sm90 body's
gemv_projections on (the decode GEMV's fp32 partials read straight by the decode kernel; where it applies).

Weights are the release's layer-0 KDA tensors with every tensor-parallel axis divided by tp (bench/rank_slice
local tables), random, bf16; state and conv window random. CUPTI device time, median of bench/device_time's
runs; kernels counted per call.
"""

import contextlib
import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.device_time import device_us, kernel_names  # noqa: E402
from bench.rank_slice import init_local_params, local_cfg, truncate  # noqa: E402
from k3jax.config import preset  # noqa: E402
from k3jax.layers import kda  # noqa: E402

CASES = [(16, 1), (16, 8), (16, 64), (8, 1), (8, 8)]  # (tp, batch): 6 and 12 local heads


def layer_inputs(cfg, B, seed=0):
    """x [B, D] bf16, state [B, H, K, V] fp32, conv window [B, 3, 3, H, K] bf16: O(1) like real activations."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    x = jax.random.normal(k1, (B, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
    state = 0.3 * jax.random.normal(k2, (B, H, K, K), jnp.float32)
    window = jax.random.normal(k3, (B, 3, cfg.kda_conv_size - 1, H, K), jnp.float32).astype(jnp.bfloat16)
    return x, state, window


def gemv_body():
    """While active, the sm90 body's kda_decode_x runs with gemv_projections on (the api looks ops up on the
    body module at call time)."""
    from pallas_kernels.kda_decode import bodies, sm90
    return _patched(sm90, "kda_decode_x", bodies.entry_points(dict(sm90.TUNING, gemv_projections=True)).kda_decode_x)


@contextlib.contextmanager
def _patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def main(out_dir):
    dev = jax.devices()[0]
    results = dict(device=f"{dev.device_kind} (cc {getattr(dev, 'compute_capability', '?')})",
                   jax=jax.__version__, what="kda.kda_decode: projections -> state step -> o_proj partial",
                   rows=[])
    for tp in sorted({tp for tp, _ in CASES}, reverse=True):
        cfg = truncate(preset("k3"), 1)  # layer 0: a KDA layer
        p = init_local_params(cfg, tp)["layers"][0]["attn"]
        lcfg = local_cfg(cfg, tp)
        for B in [b for t, b in CASES if t == tp]:
            x, state, window = layer_inputs(lcfg, B)
            row = dict(tp=tp, heads=lcfg.kda_num_heads, B=B)
            outs = {}
            for backend in ("xla", "latency_specialized", "gemv"):
                f = jax.jit(lambda p, x, s, w, backend=backend, c=lcfg: kda.kda_decode(
                    p, x, c, s, w, "latency_specialized" if backend == "gemv" else backend))
                with gemv_body() if backend == "gemv" else contextlib.nullcontext():  # while f is traced
                    try:
                        outs[backend] = f(p, x, state, window)
                        row[f"{backend}_us"] = device_us(f, p, x, state, window)
                        row[f"{backend}_kernels"] = len(kernel_names(f, p, x, state, window))
                    except Exception as e:  # noqa: BLE001  (a failure is a row entry, not the end of the run)
                        row[f"{backend}_us"] = f"failed: {type(e).__name__}: {e}"[:300]
            for name in ("latency_specialized", "gemv"):
                if name in outs and "xla" in outs:
                    a, b = (o[0].astype(jnp.float32) for o in (outs[name], outs["xla"]))
                    row[f"{name}_o_proj_rel_rms"] = float(jnp.sqrt(jnp.mean((a - b) ** 2) / jnp.mean(b ** 2)))
                    row[f"{name}_speedup"] = row["xla_us"] / row[f"{name}_us"]
            results["rows"].append(row)
            print(row, flush=True)
            pathlib.Path(out_dir, "kda_layer.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
