"""MXFP4 (OCP microscaling FP4) as stored by compressed-tensors `mxfp4-pack-quantized` (K3_SPEC §7.2).

Logical weight W [..., out, in]; groups of 32 consecutive `in` elements share one E8M0 scale byte.
- codes: uint8 [..., out, in/2]; byte j holds element 2j in its LOW nibble and 2j+1 in its HIGH nibble.
- E2M1 code: bit 3 = sign, bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6}.
- scales: uint8 [..., out, in/32], value 2^(e - 127) (e = 0 is 2^-127, as in the OCP spec).
Dequantisation is exact in bf16 and fp32. Both NumPy (converter) and jnp (model) versions live here.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

GROUP = 32
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def _unpack_nibbles(packed, xp):
    lo = packed & 0x0F
    hi = packed >> 4
    return xp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize(packed, scales, dtype=jnp.bfloat16):
    """jnp: codes [..., out, in/2] + scales [..., out, in/32] -> W [..., out, in] in `dtype` (exact)."""
    codes = _unpack_nibbles(packed.astype(jnp.uint8), jnp)
    vals = jnp.asarray(E2M1_VALUES)[codes.astype(jnp.int32)]
    # 2^(e-127) built from the exponent bits directly: exact, no pow; e=0 gives 2^-127 (an fp32 subnormal).
    e = scales.astype(jnp.int32)
    scale = jnp.where(e > 0, jnp.left_shift(e, 23), 1 << 22).astype(jnp.uint32)
    scale = jnp.asarray(scale).view(jnp.float32)
    w = vals.reshape(*vals.shape[:-1], -1, GROUP) * scale[..., None]
    return w.reshape(vals.shape).astype(dtype)


def dequantize_np(packed: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """NumPy twin of `dequantize` for the converter (host side)."""
    codes = _unpack_nibbles(np.asarray(packed, np.uint8), np)
    vals = E2M1_VALUES[codes]
    scale = np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127).astype(np.float32)
    w = vals.reshape(*vals.shape[:-1], -1, GROUP) * scale[..., None]
    return w.reshape(vals.shape).astype(dtype)


def quantize_np(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round W [..., out, in] to MXFP4: OCP MX rule, scale 2^(floor(log2(group amax)) - 2) (2 = E2M1's largest
    exponent), elements rounded to the nearest E2M1 value and saturated at +-6.

    Idempotent: a dequantised group has amax in {4, 6} x scale, which gives back the same scale, so
    quantize(dequantize(quantize(w))) == quantize(w) bit for bit. (The "smallest scale whose 6 covers amax"
    rule is not: amax/scale in (3, 3.5) rounds to 3 and re-quantises one exponent lower.)
    """
    w = np.asarray(w, np.float32)
    if w.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs the input axis divisible by {GROUP}, got {w.shape}")
    g = w.reshape(*w.shape[:-1], -1, GROUP)
    amax = np.abs(g).max(axis=-1)
    _, ex = np.frexp(amax)  # amax = m * 2^ex with m in [0.5, 1): floor(log2(amax)) = ex - 1, exactly
    e = np.where(amax > 0, ex - 1 - 2 + 127, 127).clip(1, 254)
    scaled = g / np.ldexp(np.float32(1.0), e - 127)[..., None]
    mags = E2M1_VALUES[:8]
    idx = np.abs(np.abs(scaled)[..., None] - mags).argmin(axis=-1)  # ties -> smaller magnitude; > 6 -> 6
    codes = (idx | (np.signbit(scaled).astype(np.int64) << 3)).astype(np.uint8).reshape(w.shape)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, e.astype(np.uint8)
