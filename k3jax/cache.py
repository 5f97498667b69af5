"""Decode state: per-sequence lengths, the MLA latent cache, the KDA recurrent state and conv windows.

A plain dict pytree (donated to the jitted step, sharded like everything else):
  lengths  [B] int32                       tokens already in the cache, per sequence slot
  layers[L] for an MLA layer: rows [B, S, R+rope] (fp8 e4m3 or bf16), scales [B, S, 2] fp32 (fp8 only)
  layers[L] for a KDA layer:  state [B, H, K, V] fp32, conv [B, 3, W-1, H, K] (compute dtype)

FP8 scaling rule: each cached row is two vectors (the 512-wide normalised latent c and the 64-wide k_pe, which
has its own range because it is not normalised); each gets its own fp32 scale = max|x| / 448 (e4m3's largest
finite value), so every row uses e4m3's full range and no value saturates. Dequantise = fp8 value x scale.
"""

from __future__ import annotations

import jax.numpy as jnp

from k3jax.config import K3Config
from pallas_kernels.mla_decode import reference as mla_reference

FP8 = mla_reference.FP8
CACHE_DTYPES = ("fp8", "bf16")


def init_cache(cfg: K3Config, batch: int, max_len: int, dtype=jnp.bfloat16, cache_dtype: str = "fp8") -> dict:
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype must be one of {CACHE_DTYPES}, got {cache_dtype!r}")
    layers = []
    for L in range(cfg.num_hidden_layers):
        if cfg.is_mla(L):
            C = cfg.mla_cache_width
            if cache_dtype == "fp8":
                layers.append(
                    {"rows": jnp.zeros((batch, max_len, C), FP8), "scales": jnp.ones((batch, max_len, 2), jnp.float32)}
                )
            else:
                layers.append({"rows": jnp.zeros((batch, max_len, C), dtype)})
        else:
            H, K = cfg.kda_num_heads, cfg.kda_head_dim
            layers.append(
                {
                    "state": jnp.zeros((batch, H, K, K), jnp.float32),
                    "conv": jnp.zeros((batch, 3, cfg.kda_conv_size - 1, H, K), dtype),
                }
            )
    return {"lengths": jnp.zeros((batch,), jnp.int32), "layers": layers}


def cache_bytes(cfg: K3Config, batch: int, max_len: int, cache_dtype: str = "fp8", act_bytes: int = 2) -> dict:
    """Bytes of the decode state (whole model, before sharding), for the memory planner."""
    row = cfg.mla_cache_width * (1 if cache_dtype == "fp8" else act_bytes) + (8 if cache_dtype == "fp8" else 0)
    mla = len(cfg.mla_layers) * batch * max_len * row
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    kda_state = len(cfg.kda_layers) * batch * H * K * K * 4
    kda_conv = len(cfg.kda_layers) * batch * 3 * (cfg.kda_conv_size - 1) * H * K * act_bytes
    return {
        "mla_cache": mla,
        "kda_state": kda_state,
        "kda_conv": kda_conv,
        "total": mla + kda_state + kda_conv + batch * 4,
    }


def write_rows(entry: dict, rows_BTC, pos_BT, valid_BT, R: int) -> dict:
    """Scatter new rows at their absolute positions (fp8: by the scaling rule above); rows of padding tokens are
    dropped. The rule lives with the MLA kernels' reference (pallas_kernels.mla_decode.reference), which the
    kernel that writes the rows in decode is tested against."""
    return mla_reference.write_rows(entry, rows_BTC, pos_BT, valid_BT, R)


def read_rows(entry: dict, R: int, dtype):
    """The whole latent cache in the compute dtype [B, S, C]."""
    return mla_reference.dequantize(entry, R, dtype)


def reset_slots(cache: dict, slots_mask_B) -> dict:
    """Zero the lengths and recurrent state of the masked slots (a new sequence takes the slot)."""
    keep = ~slots_mask_B

    def z(x):  # where, not multiply: a slot's old state may hold inf/nan, which must not survive
        return jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))

    layers = [{k: (z(v) if k in ("state", "conv") else v) for k, v in e.items()} for e in cache["layers"]]
    return {"lengths": jnp.where(slots_mask_B, 0, cache["lengths"]), "layers": layers}
