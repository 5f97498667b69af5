"""Where the layer-boundary kernel's time goes, on one GPU (n = 1: the maths without the exchange).

  python bench/mix_norm_profile.py OUT_DIR

CUPTI device time of pallas_kernels/collectives/mix_norm.py at B = 1 / 8 with 0 / 1 / 4 / 8 stored blocks
(AttnRes online and two-pass), against XLA's reference.mix_norm of the same work, then Mosaic GPU's in-kernel
trace of the kernel's named phases (exchange, wait_loads, prefix, attnres, norm) at B = 1. Needs a CPU device
beside the GPUs (JAX_PLATFORMS=cuda,cpu): the trace is read back through a host callback.
Writes OUT_DIR/mix_norm_profile.json.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.device_time import device_us, kernel_names  # noqa: E402
from bench.kernel_trace import phases  # noqa: E402
from pallas_kernels.collectives import mix_norm, reference  # noqa: E402

D, C, EPS = 7168, 128, 1e-5
BF16 = ml_dtypes.bfloat16


def inputs(rng, b, n_blocks):
    x = rng.standard_normal((b, D)).astype(BF16)
    p = rng.standard_normal((b, D)).astype(BF16)
    blk = tuple(rng.standard_normal((b, D)).astype(BF16) for _ in range(n_blocks))  # as the model holds them
    q = (rng.standard_normal(D) / np.sqrt(D)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(D)).astype(BF16)
    return x, p, blk, q, w


def kernel_fn(n_blocks, profile_dir="", online=True):
    def f(x, p, blk, q, w):
        t = lambda a: a.reshape(*a.shape[:-1], D // C, C)  # noqa: E731
        return mix_norm.mix_norm(
            t(x),
            t(p),
            [t(b) for b in blk],
            t(q),
            t(w),
            EPS,
            axis_name="tp",
            n=1,
            profile_dir=profile_dir,
            online=online,
        )

    return jax.jit(f)


def xla_fn(x, p, blk, q, w):
    return reference.mix_norm(x, p, blk, q, jnp.ones_like(q), w, EPS)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "bench/results"
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(0)
    results = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=[], phases={})
    for b in (1, 8):
        for n_blocks in (0, 1, 4, 8):
            args = jax.tree.map(jnp.asarray, inputs(rng, b, n_blocks))
            row = dict(
                B=b,
                blocks=n_blocks,
                pallas_online_us=device_us(kernel_fn(n_blocks), *args),
                pallas_two_pass_us=device_us(kernel_fn(n_blocks, online=False), *args),
                xla_us=device_us(jax.jit(xla_fn), *args),
                xla_kernels=len(kernel_names(jax.jit(xla_fn), *args)),
            )
            results["rows"].append(row)
            print(row, flush=True)
            save(out, results)
    for n_blocks, online in ((0, True), (8, True), (8, False)):
        name = f"B1 blocks{n_blocks} {'online' if online else 'two-pass'}"
        tdir = os.path.join(out, "trace " + name)
        os.makedirs(tdir, exist_ok=True)
        args = jax.tree.map(jnp.asarray, inputs(rng, 1, n_blocks))
        jax.block_until_ready(kernel_fn(n_blocks, tdir, online)(*args))
        results["phases"][name] = phases(tdir)
        print("phases", name, results["phases"][name], flush=True)
        save(out, results)
    save(out, results)


def save(out, results):
    with open(os.path.join(out, "mix_norm_profile.json"), "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
