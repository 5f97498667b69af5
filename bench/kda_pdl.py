"""Programmatic dependent launch (PDL) between the decode GEMV and the KDA decode kernel, on one GPU.

With tuning "pdl", the decode kernel (fed by the GEMV's partials) may start while the GEMV still runs: it
issues its state's TMA, then griddepcontrol.wait holds it until the GEMV's partials are there (kernel.py
_body). That overlaps the state read and the launch with the GEMV's tail, which CUPTI's summed kernel time
cannot show: the decode kernel's own duration grows by the time it spends waiting. So this bench reports both:
- wall us per sublayer: a chain of LAYERS KDA sublayers (distinct weight and state buffers, each x the last
  one's o_proj output) in one jitted call, CALLS calls dispatched back to back and waited for once, the median
  of REPEATS such runs divided by CALLS x LAYERS. The chain is long enough (~0.4-0.7 ms of GPU work per call)
  that the host's dispatch stays ahead, so this is the GPU's time including the gaps between kernels;
- CUPTI us per sublayer (summed kernel time) and one sublayer's kernels.

  PYTHONPATH=. python3 bench/kda_pdl.py OUT_DIR  (GPU; writes OUT_DIR/kda_pdl.json)
"""

import json
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.device_time import device_us, per_kernel_us  # noqa: E402
from bench.kda_layer import layer_inputs  # noqa: E402
from bench.rank_slice import init_local_params, local_cfg, truncate  # noqa: E402
from k3jax.config import preset  # noqa: E402
from k3jax.layers import kda  # noqa: E402
from pallas_kernels.kda_decode import sm90  # noqa: E402

LAYERS, CALLS, REPEATS = 16, 20, 7
CASES = [(16, 1), (16, 8), (16, 16), (16, 64), (8, 1)]


def chain_fn(lcfg):
    def chain(ps, x, states, windows, active):
        outs = []
        for p, s, w in zip(ps, states, windows, strict=True):
            y, s2, w2 = kda.kda_decode(p, x, lcfg, s, w, "latency_specialized", active_B=active)
            outs.append((s2, w2))
            x = y.astype(x.dtype)
        return x, outs
    return jax.jit(chain)


def wall_us(f, *args):
    jax.block_until_ready(f(*args))
    runs = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        out = [f(*args) for _ in range(CALLS)]
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) / CALLS * 1e6)
        del out
    return statistics.median(runs)


def main(out_dir):
    dev = jax.devices()[0]
    results = dict(device=f"{dev.device_kind} (cc {getattr(dev, 'compute_capability', '?')})", jax=jax.__version__,
                   layers=LAYERS, calls=CALLS, repeats=REPEATS, rows=[])
    cfg = truncate(preset("k3"), 1)
    for tp in sorted({tp for tp, _ in CASES}, reverse=True):
        p0 = init_local_params(cfg, tp)["layers"][0]["attn"]
        ps = [jax.tree.map(lambda a: a * 1, p0) for _ in range(LAYERS)]  # distinct buffers: no L2 reuse
        lcfg = local_cfg(cfg, tp)
        for B in [b for t, b in CASES if t == tp]:
            x, state, window = layer_inputs(lcfg, B)
            states = [state + i for i in range(LAYERS)]
            windows = [window for _ in range(LAYERS)]
            active = jnp.ones((B,), jnp.int32).at[B - 1].set(0 if B > 1 else 1)
            args = (ps, x, states, windows, active)
            row = dict(tp=tp, B=B)
            outs = {}
            for pdl in (False, True):
                sm90.TUNING["pdl"] = pdl
                f = chain_fn(lcfg)  # a fresh jit: traced with this tuning
                key = "pdl" if pdl else "plain"
                try:
                    outs[key] = f(*args)
                    row[f"{key}_wall_us"] = wall_us(f, *args) / LAYERS
                    row[f"{key}_cupti_us"] = device_us(f, *args) / LAYERS
                    row[f"{key}_kernels"] = [(n, round(t, 2)) for n, t in per_kernel_us(f, *args)[:4]]
                except Exception as e:  # noqa: BLE001
                    row[f"{key}_wall_us"] = f"failed: {type(e).__name__}: {e}"[:300]
            sm90.TUNING["pdl"] = False
            if len(outs) == 2:
                row["same_bits"] = all(bool(jnp.array_equal(a, b)) for a, b in zip(
                    jax.tree.leaves(outs["plain"]), jax.tree.leaves(outs["pdl"]), strict=True))
            results["rows"].append(row)
            print(row, flush=True)
            pathlib.Path(out_dir, "kda_pdl.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
