"""Shared by the sharding tests, and one process of the multi-host test.

As a script: join the job (k3jax.distributed from the JAX_* environment), build the test model sharded over
the GLOBAL tp mesh, greedy-generate, and (process 0) write the tokens as JSON:
  python tests/multihost_worker.py OUT.json SEED TP
`generate_tokens` is also called in-process by the single-process 16-device reference.
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np


def demo4_config():
    """The demo model's widths (every TP size up to 16 is valid) with 4 of its 8 layers, to keep CPU compiles
    short: layer 0 dense KDA, layers 1-2 MoE KDA, layer 3 MoE MLA."""
    from k3jax.config import preset

    return preset("demo").replace(num_hidden_layers=4, full_attn_layers=(4,))


def numpy_params(cfg, seed: int, dtype=np.float32) -> dict:
    """Random parameters drawn in NumPy with the tensor table's init kinds (params.init_tensor's ranges).
    NumPy, because jax.random over ~100 distinct shapes costs ~40 s of CPU compiles."""
    from k3jax import params as params_lib

    rng = np.random.default_rng(seed)
    out = {}
    for s in params_lib.tensor_table(cfg):
        x = draw(s, rng)
        out[s.path] = x.astype(np.uint8 if s.dtype == "uint8" else (np.float32 if s.dtype == "float32" else dtype))
    return params_lib.unflatten(out)


def draw(s, rng):
    """A NumPy random value for tensor spec s, at the scale its init kind asks for."""
    if s.init == "codes":
        return rng.integers(0, 256, s.shape)
    if s.init == "scales":  # as params.init_tensor: keeps expert outputs O(1)
        return 127 - round(math.log2(2.3 * math.sqrt(s.fan_in))) + rng.integers(-1, 2, s.shape)
    if s.init == "alog":
        return np.log(rng.uniform(1.0, 16.0, s.shape))
    n = rng.standard_normal(s.shape)
    scale, shift = {
        "linear": (1 / math.sqrt(s.fan_in), 0.0),
        "embed": (1.0, 0.0),
        "norm": (0.1, 1.0),
        "conv": (0.5, 0.0),
        "dt_bias": (0.5, -1.0),
        "router_bias": (0.1, 0.0),
    }[s.init]
    return scale * n + shift


def place(params_np: dict, shardings: dict) -> dict:
    """Host arrays -> global sharded arrays; each process materialises only its own shards (multi-host safe)."""
    import jax

    return jax.tree.map(lambda a, s: jax.make_array_from_callback(a.shape, s, lambda idx: a[idx]), params_np, shardings)


def prompts_for(seed: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed + 1)
    return [rng.integers(0, vocab - 8, size=n).tolist() for n in (5, 9)]


def generate_tokens(seed: int, tp: int, max_new: int = 6) -> list[list[int]]:
    import jax.numpy as jnp

    from k3jax import sharding as sh
    from k3jax.engine import Engine

    cfg = demo4_config()
    mesh = sh.make_mesh(tp)
    params = place(numpy_params(cfg, seed), sh.param_shardings(cfg, mesh))
    eng = Engine(
        cfg, params, max_len=32, max_batch=2, dtype=jnp.float32, cache_dtype="bf16", mesh=mesh, steps_per_call=max_new
    )
    return eng.generate(prompts_for(seed, cfg.vocab_size), max_new_tokens=max_new, stop_ids=[-1]).tokens


def main():
    out, seed, tp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
    from k3jax import distributed

    assert distributed.initialize(), "expected a multi-process environment (JAX_COORDINATOR_ADDRESS etc.)"
    toks = generate_tokens(seed, tp)
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "tokens": toks,
                    "processes": jax.process_count(),
                    "devices": len(jax.devices()),
                    "local_devices": len(jax.local_devices()),
                },
                f,
            )


if __name__ == "__main__":
    main()
