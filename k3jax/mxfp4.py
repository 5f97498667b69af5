"""MXFP4 (OCP microscaling FP4) as stored by compressed-tensors `mxfp4-pack-quantized` (docs/model.md §7.2).

Logical weight W [..., out, in]; groups of 32 consecutive `in` elements share one E8M0 scale byte.
- codes: uint8 [..., out, in/2]; byte j holds element 2j in its LOW nibble and 2j+1 in its HIGH nibble.
- E2M1 code: bit 3 = sign, bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6}.
- scales: uint8 [..., out, in/32], value 2^(e - 127) (e = 0 is 2^-127, as in the OCP spec).
Dequantisation is exact in bf16 and fp32. The jnp maths (what the model and its kernels decode) lives in
pallas_kernels.moe.mxfp4, re-exported here; the NumPy converter versions are here.
"""

from __future__ import annotations

import numpy as np

from pallas_kernels.moe.mxfp4 import (  # noqa: F401
    E2M1_VALUES,
    GROUP,
    dequantize,
    e2m1_values,
    matvec,
    unpack_nibbles,
)


def dequantize_np(packed: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """NumPy twin of `dequantize` for the converter (host side)."""
    codes = unpack_nibbles(np.asarray(packed, np.uint8), np)
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
