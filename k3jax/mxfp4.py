"""MXFP4 (OCP microscaling FP4) as stored by compressed-tensors `mxfp4-pack-quantized` (docs/model.md §7.2).

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
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)


def _unpack_nibbles(packed, xp):
    lo = packed & 0x0F
    hi = packed >> 4
    return xp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _scale_values(scales):
    """E8M0 bytes -> 2^(e-127) in fp32, built from the exponent bits: exact, no pow; e=0 gives 2^-127."""
    e = scales.astype(jnp.int32)
    return jnp.where(e > 0, jnp.left_shift(e, 23), 1 << 22).astype(jnp.uint32).view(jnp.float32)


def dequantize(packed, scales, dtype=jnp.bfloat16):
    """jnp: codes [..., out, in/2] + scales [..., out, in/32] -> W [..., out, in] in `dtype` (exact)."""
    codes = _unpack_nibbles(packed.astype(jnp.uint8), jnp)
    vals = jnp.asarray(E2M1_VALUES)[codes.astype(jnp.int32)]
    w = vals.reshape(*vals.shape[:-1], -1, GROUP) * _scale_values(scales)[..., None]
    return w.reshape(vals.shape).astype(dtype)


def e2m1_values(nibbles):
    """E2M1 codes (0..15, any int dtype) -> fp32 values by arithmetic, not a table lookup (elementwise, so XLA
    may fuse it into its consumer). Magnitude index m = 2e + b: e = 0 -> b / 2, else (1 + b/2) 2^(e-1)."""
    c = nibbles.astype(jnp.int32)
    e, b = (c >> 1) & 3, (c & 1).astype(jnp.float32)
    mag = jnp.where(e == 0, 0.5 * b, (1.0 + 0.5 * b) * jnp.left_shift(1, e).astype(jnp.float32) * 0.5)
    return jnp.where(c & 8, -mag, mag)


def matvec(x_in, packed, scales):
    """y[..., out] = sum_in W[..., out, in] x[..., in] in fp32, read straight from the packed codes.

    x_in broadcasts against packed's leading dims ([..., in], no `out` axis). No bf16 copy of W is written:
    the two nibbles of a byte meet the even and odd inputs and their group's scale (a power of two: exact),
    in one reduction over (group, pair), which gives XLA the chance to fuse gather + decode + multiply +
    reduce into one pass over the packed bytes. XLA:CPU does not take it (it rewrites the reduce as a dot and
    materialises the decoded values; bench/NOTES.md); XLA:GPU is not measured yet.
    Products of a bf16 x and an E2M1 value are exact in fp32; only the summation order differs from
    dequantize() followed by an fp32-accumulating dot.
    """
    *lead, out, half = packed.shape
    groups = half * 2 // GROUP
    x = x_in.astype(jnp.float32).reshape(*x_in.shape[:-1], 1, groups, GROUP // 2, 2)  # [..., 1(out), g, j, 2]
    codes = packed.reshape(*lead, out, groups, GROUP // 2)
    pair = e2m1_values(codes & 0x0F) * x[..., 0] + e2m1_values(codes >> 4) * x[..., 1]
    return jnp.sum(pair * _scale_values(scales)[..., None], axis=(-2, -1))


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
