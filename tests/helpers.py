"""Test helpers: random parameters in our layout and the same tensors in HF layout for the NumPy oracle."""

import json

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import params as P
from k3jax.transforms import params_to_hf


def edit_json(path, edit) -> None:
    """Load a JSON file, let `edit` change the dict in place, write it back (bad-input tests)."""
    with open(path) as f:
        data = json.load(f)
    edit(data)
    with open(path, "w") as f:
        json.dump(data, f)


def rel_rms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


def random_model(cfg, seed, dtype=jnp.float32):
    """(params in the compute dtype, HF dict for np_reference keyed without the language_model. prefix)."""
    params = P.init_params(cfg, seed)
    table = P.tensor_table(cfg)
    flat = {s.path: np.asarray(jax.device_get(P.get_path(params, s.path))) for s in table}
    hf = params_to_hf(flat, table)
    hf_ref = {}
    for name, arr in hf.items():
        name = name.removeprefix("language_model.")
        name = name.removeprefix("model.")
        hf_ref[name] = arr if arr.dtype == np.uint8 else np.asarray(arr, np.float64)
    return P.cast_params(params, dtype), hf_ref
