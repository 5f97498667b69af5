"""MXFP4 (OCP microscaling FP4) as stored by compressed-tensors `mxfp4-pack-quantized` (docs/model.md §7.2), in jnp:
what the routed-experts reference and kernel decode. (k3jax.mxfp4 re-exports these beside its NumPy converter.)

Logical weight W [..., out, in]; groups of 32 consecutive `in` elements share one E8M0 scale byte.
- codes: uint8 [..., out, in/2]; byte j holds element 2j in its LOW nibble and 2j+1 in its HIGH nibble.
- E2M1 code: bit 3 = sign, bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6}.
- scales: uint8 [..., out, in/32], value 2^(e - 127) (e = 0 is 2^-127, as in the OCP spec).
Dequantisation is exact in bf16 and fp32.

The kernel's decode (e2m1_bf16) builds the scaled value's bf16 bits with integer operations only, because
Hopper has no e2m1 convert and a float multiply by the scale could flush the 0.5 code's subnormal
intermediate to zero: it is written here, over plain arrays, so one function serves the kernel's registers
and the exhaustive test of every (code, scale) pair.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 32
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)


def unpack_nibbles(packed, xp=jnp):
    lo = packed & 0x0F
    hi = packed >> 4
    return xp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def scale_values(scales):
    """E8M0 bytes -> 2^(e-127) in fp32, built from the exponent bits: exact, no pow; e=0 gives 2^-127."""
    e = scales.astype(jnp.int32)
    return jnp.where(e > 0, jnp.left_shift(e, 23), 1 << 22).astype(jnp.uint32).view(jnp.float32)


def dequantize(packed, scales, dtype=jnp.bfloat16):
    """codes [..., out, in/2] + scales [..., out, in/32] -> W [..., out, in] in `dtype` (exact)."""
    codes = unpack_nibbles(packed.astype(jnp.uint8))
    vals = jnp.asarray(E2M1_VALUES)[codes.astype(jnp.int32)]
    w = vals.reshape(*vals.shape[:-1], -1, GROUP) * scale_values(scales)[..., None]
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
    return jnp.sum(pair * scale_values(scales)[..., None], axis=(-2, -1))


# ------------------------------------------------------------------ the kernel's decode: bf16 bits by integers
def e2m1_scale_terms(scales):
    """E8M0 scale bytes (any int dtype) -> the two uint16 per-group inputs of e2m1_bf16: the exponent term
    (e - 1) << 7 and the magnitude mask (7, or 0 where e = 0). Computed once per (row, group), not per element."""
    s = scales.astype(jnp.uint16)
    zero = s == 0
    return jnp.where(zero, jnp.uint16(0), (s - 1) << 7), jnp.where(zero, jnp.uint16(0), jnp.uint16(7))


def e2m1_bf16(nibbles, exp_term, mag_mask):
    """E2M1 codes (uint16, 0..15) x 2^(e-127) -> bf16, by building the bits (shapes broadcast together).

    Magnitude index m = code & 7: m << 6 is the bf16 bit pattern ee << 7 | b << 6 of 2^-126 x E2M1(m) for
    m >= 2, so adding (e - 1) << 7 to its exponent field gives E2M1(m) x 2^(e-127) exactly; m = 1 (0.5) has no
    normal pattern there, its value 2^(e-128) is (e - 1) << 7 alone; m = 0 is zero. The sign is bit 15.
    Exact for every scale byte e >= 2 and, at e = 1, for every code but +-0.5 (its 2^-127 is a bf16
    subnormal; it decodes to +-0); at e = 0 (2^-127) every code decodes to +-0 (true values below 2^-124).
    A quantiser never writes those two scales for weights of any size (k3jax.mxfp4.quantize_np clips e to
    >= 1 and only an all-zero group gets a scale below 2^-124's)."""
    m = nibbles & mag_mask
    mag = jnp.where(m < 2, jnp.uint16(0), m << 6)
    bits = jnp.where(m == 0, jnp.uint16(0), mag + exp_term) | ((nibbles & 8) << 12)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def dequantize_by_bits(packed, scales):
    """dequantize() through e2m1_bf16 (bf16 out), in the kernel's lo/hi nibble split: the test's view of the
    kernel's decode."""
    exp_term, mag_mask = (jnp.repeat(t, GROUP // 2, axis=-1) for t in e2m1_scale_terms(scales))
    c = packed.astype(jnp.uint16)
    lo = e2m1_bf16(c & 0x0F, exp_term, mag_mask)
    hi = e2m1_bf16(c >> 4, exp_term, mag_mask)
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
