"""Where a KDA sublayer's decode time goes: its kernels one by one (CUPTI), and the bf16 GEMV variants its
projections could take, each against the bytes it must read (weights dominate at small batch).

  PYTHONPATH=. python3 bench/kda_layer_kernels.py OUT_DIR     (GPU; writes OUT_DIR/kda_layer_kernels.json)
  PYTHONPATH=. python3 bench/kda_layer_kernels.py --linear OUT_DIR TAG [--no-time]
      the sublayer with its projections computed other ways (layer_variants): each one's kernels, device time
      and error against float32 -> OUT_DIR/kda_layer_linear_TAG.json (--no-time: errors only, runs on CPU)

Why: bench/kda_layer.py measured the whole sublayer at ~3x its weight-read floor at batch 1 (TP16: 35.6 us vs
~12 us), with the state step only ~4-6 us of it; this says which kernels hold the rest.
"""

import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.device_time import device_us, kernel_names, per_kernel_us  # noqa: E402
from bench.kda_decode import HBM_PEAK  # noqa: E402
from bench.kda_layer import layer_inputs  # noqa: E402
from bench.rank_slice import init_local_params, local_cfg, truncate  # noqa: E402
from k3jax.config import preset  # noqa: E402
from k3jax.layers import kda  # noqa: E402
from pallas_kernels.policy import DecodePolicy  # noqa: E402


def gemv_rows(D, N, B, key):
    """x [B, D] bf16 @ W, W bf16 in [D, N] or [N, D] (the table's layout for KDA's qkvg, f_a, o), fp32 or bf16
    result."""
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (B, D), jnp.float32).astype(jnp.bfloat16)
    w_DN = jax.random.normal(kw, (D, N), jnp.float32).astype(jnp.bfloat16)
    w_ND = w_DN.T.copy()
    floor_us = (D * N * 2 + B * D * 2 + B * N * 4) / HBM_PEAK * 1e6
    fns = {
        "DN f32": (jax.jit(lambda x, w: jnp.einsum("bd,dn->bn", x, w, preferred_element_type=jnp.float32)), w_DN),
        "DN bf16": (jax.jit(lambda x, w: jnp.einsum("bd,dn->bn", x, w)), w_DN),
        "ND f32": (jax.jit(lambda x, w: jnp.einsum("bd,nd->bn", x, w, preferred_element_type=jnp.float32)), w_ND),
        "ND bf16": (jax.jit(lambda x, w: jnp.einsum("bd,nd->bn", x, w)), w_ND),
    }
    row = dict(D=D, N=N, B=B, floor_us=floor_us)
    for name, (f, w) in fns.items():
        us = device_us(f, x, w)
        row[name] = dict(us=us, hbm_pct=100 * floor_us / us, kernels=kernel_names(f, x, w))
    print(row, flush=True)
    return row


def main(out_dir):
    out = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, layer=[], gemv=[])
    cfg = truncate(preset("k3"), 1)
    for tp, B in [(16, 1), (16, 8), (8, 1)]:
        lcfg = local_cfg(cfg, tp)
        p = init_local_params(cfg, tp)["layers"][0]["attn"]
        x, state, window = layer_inputs(lcfg, B)
        for backend in ("xla", "latency_specialized"):
            f = jax.jit(
                lambda p, x, s, w, backend=backend, c=lcfg: kda.kda_decode(p, x, c, s, w, DecodePolicy(backend))
            )
            ks = per_kernel_us(f, p, x, state, window)
            row = dict(
                tp=tp,
                B=B,
                backend=backend,
                total_us=sum(t for _, t in ks),
                kernels=ks,
                shapes={k: list(v.shape) for k, v in p.items()},
            )
            print(row, flush=True)
            out["layer"].append(row)
            pathlib.Path(out_dir, "kda_layer_kernels.json").write_text(json.dumps(out, indent=1))
    D = cfg.hidden_size
    for N, B in [(3072, 1), (3072, 8), (128, 1), (6144, 1)]:
        out["gemv"].append(gemv_rows(D, N, B, jax.random.key(N + B)))
    for K, B in [(768, 1), (1536, 1)]:  # o_proj: [B, K] @ [K, D]
        out["gemv"].append(gemv_rows(K, D, B, jax.random.key(K + B)))
    pathlib.Path(out_dir, "kda_layer_kernels.json").write_text(json.dumps(out, indent=1))


def bf16_out_linear(x, w, spec):
    """linear with the GEMM's result in x's dtype (fp32 accumulation inside the kernel, one rounding at the end
    unless XLA splits K and reduces the partials in x's dtype)."""
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=x.dtype)


# The in-major ([in, out], table version 2) layout of the three projection weights the table now keeps
# out-major, and linear's spec for each: the comparison that moved them (at batch 1 out-major reads faster).
_IN_MAJOR_SPECS = {"bd,shkd->bshk": "bd,dshk->bshk", "bd,rd->br": "bd,dr->br"}


def in_major(p):
    return dict(p, qkvg=jnp.transpose(p["qkvg"], (3, 0, 1, 2)), f_a=p["f_a"].T, o=jnp.transpose(p["o"], (1, 2, 0)))


def layer_variants():
    """name -> (params transform, {module attribute: replacement}) for kda.kda_decode's projections."""
    from k3jax.layers import common

    in_major_linear = lambda x, w, spec: common.linear(x, w, _IN_MAJOR_SPECS.get(spec, spec))  # noqa: E731
    return {
        "f32_then_round": (lambda p: p, {}),  # the model's rule, the table's out-major weights: what runs today
        "bf16_out": (lambda p: p, {(kda, "linear"): bf16_out_linear, (common, "linear"): bf16_out_linear}),
        "in_major_f32": (in_major, {(kda, "linear"): in_major_linear, (kda, "o_proj"): common.row_parallel}),
    }


def main_linear_variants(out_dir, tag, time=True):
    """The sublayer under each of layer_variants (latency_specialized), each one's kernels and device time and
    its error against a float32 run of the same weights (precision highest). time=False (CPU): errors only."""
    out = dict(
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
        measure="CUPTI device time, median",
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        rows=[],
    )
    cfg = truncate(preset("k3"), 1)
    for tp, B in [(16, 1), (16, 8), (8, 1)]:
        lcfg = local_cfg(cfg, tp)
        p = init_local_params(cfg, tp)["layers"][0]["attn"]
        x, state, window = layer_inputs(lcfg, B)
        with jax.default_matmul_precision("highest"):
            p32 = jax.tree.map(lambda a: a.astype(jnp.float32), p)
            exact = jax.jit(lambda p, x, s, w, c=lcfg: kda.kda_decode(p, x, c, s, w, "xla"))(
                p32, x.astype(jnp.float32), state, window.astype(jnp.float32)
            )[0]
        row = dict(tp=tp, B=B)
        for name, (transform, patches) in layer_variants().items():
            saved = {k: getattr(*k) for k in patches}
            for (mod, attr), fn in patches.items():
                setattr(mod, attr, fn)
            try:
                pv = jax.jit(transform)(p)
                f = jax.jit(lambda p, x, s, w, c=lcfg: kda.kda_decode(p, x, c, s, w, "latency_specialized"))
                y = f(pv, x, state, window)[0].astype(jnp.float32)
                row[name] = dict(rel_rms_vs_fp32=float(jnp.sqrt(jnp.mean((y - exact) ** 2) / jnp.mean(exact**2))))
                if time:
                    ks = per_kernel_us(f, pv, x, state, window)
                    row[name].update(us=sum(t for _, t in ks), kernels=ks)
            finally:
                for (mod, attr), fn in saved.items():
                    setattr(mod, attr, fn)
        print(tag, row, flush=True)
        out["rows"].append(row)
    pathlib.Path(out_dir, f"kda_layer_linear_{tag}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--linear"]:
        main_linear_variants(sys.argv[2], sys.argv[3], time="--no-time" not in sys.argv)
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else ".")
