"""The MoE routing step (pallas_kernels.moe_route) on one GPU, CUPTI device time: the Mosaic GPU top-k kernel
against XLA's lax.top_k path (today's model code after the sigmoid), at E = 896, k = 16, T = 1, 8, 64, 512.

Run on the device machine from the repo root: PYTHONPATH=. python3 bench/moe_route.py OUT
-> OUT/moe_route.json and OUT/moe_route.md. Every variant is checked against the XLA reference first (sel
exactly, w to 1e-6); one that fails to compile, run or match becomes a "failed: ..." entry.

Rows: route/xla (top_k + gather + renormalise, biased scores given), route/kernel (the same inputs),
route/kernel_bias (the bias [E] added in the kernel, as the model could call it). The grouping by expert is
pallas_kernels/moe/grouping.py (three compare-sum XLA fusions + a pair_rows TMA copy kernel), timed as part of
the routed experts by bench/moe_layer.py; bench/results/moe_route.md's group/* and route+group rows measured
forms since removed.
"""

import json
import pathlib
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench.device_time import device_us, kernel_names
from pallas_kernels.moe_route import kernel, reference

E, K = 896, 16
TOKENS = (1, 8, 64, 512)


def inputs(T, seed=0):
    r = np.random.default_rng(seed + T)
    s = 1 / (1 + np.exp(-2 * r.standard_normal((T, E))))
    bias = 0.3 * r.standard_normal(E)
    s, bias = jnp.asarray(s, jnp.float32), jnp.asarray(bias, jnp.float32)
    return s, bias, s + bias


def variants():
    return {
        "route/xla": (jax.jit(lambda s, b: reference.route(s, b, k=K)), "biased"),
        "route/kernel": (jax.jit(lambda s, b: kernel.route(s, b, k=K)), "biased"),
        "route/kernel_bias": (jax.jit(lambda s, b: kernel.route(s, bias_E=b, k=K)), "bias"),
    }


def check(out, want):
    sel, w = out
    if not np.array_equal(np.asarray(sel), np.asarray(want[0])):
        raise AssertionError("sel differs from lax.top_k's")
    err = float(np.max(np.abs(np.asarray(w) - np.asarray(want[1]))))
    if err > 1e-6:
        raise AssertionError(f"w off by {err}")


def main(out_dir):
    rows = []
    for T in TOKENS:
        s, bias, biased = inputs(T)
        want = jax.jit(lambda s, b: reference.route(s, b, k=K))(s, biased)
        args_of = {"biased": (s, biased), "bias": (s, bias)}
        for name, (f, form) in variants().items():
            row = {"T": T, "E": E, "k": K, "variant": name}
            args = args_of[form]
            try:
                check(f(*args), want)
                row["us"] = device_us(f, *args)
                row["kernels"] = kernel_names(f, *args)
            except Exception as e:  # noqa: BLE001
                row["us"] = f"failed: {type(e).__name__}: {e}"[:300]
                traceback.print_exc()
            rows.append(row)
            print(json.dumps(row), flush=True)
            pathlib.Path(out_dir, "moe_route.json").write_text(json.dumps(rows, indent=1))
    rows.append(signed_zeros())
    print(json.dumps(rows[-1]), flush=True)
    pathlib.Path(out_dir, "moe_route.json").write_text(json.dumps(rows, indent=1))
    pathlib.Path(out_dir, "moe_route.md").write_text(markdown(rows))


def signed_zeros():
    """Whether the GPU's lax.top_k orders -0 below +0 (total order, as XLA on CPU and the kernel) or ties them
    (XLA's GPU TopK kernel compares floats): biased scores of only +0, -0 and -1. Sigmoid scores never give -0,
    so this only says which comparator the reference has."""
    T = 8
    b = np.full((T, E), -1.0, np.float32)
    b[:, ::3], b[:, 1::3] = 0.0, -0.0
    s, b = jnp.full((T, E), 0.5, jnp.float32), jnp.asarray(b)
    want = jax.jit(lambda s, b: reference.route(s, b, k=K))(s, b)[0]
    row = {"variant": "signed zeros", "xla_top_k_total_order": bool(np.all(np.asarray(want) % 3 == 0))}
    try:
        got = jax.jit(lambda s, b: kernel.route(s, b, k=K))(s, b)[0]
        row["kernel_equals_xla"] = bool(np.array_equal(np.asarray(got), np.asarray(want)))
    except Exception as e:  # noqa: BLE001
        row["kernel_equals_xla"] = f"failed: {type(e).__name__}: {e}"[:300]
    return row


def markdown(rows):
    """One table: a row per variant, a column per T (device us, kernels launched)."""
    cell, zeros = {}, [r for r in rows if r["variant"] == "signed zeros"]
    rows = [r for r in rows if r["variant"] != "signed zeros"]
    names = list(dict.fromkeys(r["variant"] for r in rows))
    for r in rows:
        us = r["us"]
        cell[r["variant"], r["T"]] = f"{us:.2f} ({len(r['kernels'])})" if isinstance(us, float) else "failed"
    lines = [
        f"MoE routing, E = {E}, k = {K}: CUPTI device us per call (kernels launched), {jax.devices()[0].device_kind}",
        "",
        "| variant | " + " | ".join(f"T = {T}" for T in TOKENS) + " |",
        "|---|" + "---|" * len(TOKENS),
    ]
    lines += [f"| {n} | " + " | ".join(cell.get((n, T), "") for T in TOKENS) + " |" for n in names]
    lines += ["", f"signed zeros: {zeros[0]}"] if zeros else []
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
