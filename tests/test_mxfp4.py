"""MXFP4 (docs/model.md §7.2): bit-exact round trip, jnp == NumPy == the independent oracle, golden nibble order."""

import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest

from k3jax import mxfp4

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _random_weights(rng, shape):
    """Gaussian rows spanning many binades, a few exact (+-)zeros and a group that is all zero."""
    w = rng.standard_normal(shape) * np.exp2(rng.uniform(-30, 30, shape[:-1] + (1,)))
    w[..., rng.integers(shape[-1], size=5)] = 0.0
    w[..., 0, :32] = -0.0
    return w.astype(np.float32)


def test_round_trip_bit_exact(rng):
    w = _random_weights(rng, (3, 24, 32 * int(rng.integers(1, 6))))
    codes, scales = mxfp4.quantize_np(w)
    assert codes.shape == w.shape[:-1] + (w.shape[-1] // 2,) and codes.dtype == np.uint8
    assert scales.shape == w.shape[:-1] + (w.shape[-1] // 32,) and scales.dtype == np.uint8
    codes2, scales2 = mxfp4.quantize_np(mxfp4.dequantize_np(codes, scales))
    np.testing.assert_array_equal(scales2, scales)
    np.testing.assert_array_equal(codes2, codes)


def test_quantize_picks_a_nearest_grid_value(rng):
    """Every element lands on (one of) the nearest representable values of its group's scale."""
    w = _random_weights(rng, (16, 96))
    codes, scales = mxfp4.quantize_np(w)
    dq = ref.mxfp4_dequant(codes, scales)
    scale = np.repeat(np.exp2(scales.astype(np.float64) - 127), 32, axis=-1)
    signed = np.concatenate([GRID, -GRID])
    best = np.min(np.abs(w[..., None].astype(np.float64) - signed * scale[..., None]), axis=-1)
    np.testing.assert_array_equal(np.abs(w - dq), best)
    # the scale is the OCP MX one: the group max lands in [4, 8) x scale
    amax = np.abs(w.astype(np.float64)).reshape(16, -1, 32).max(-1)
    ratio = amax / np.exp2(scales.astype(np.float64) - 127)
    assert np.all((ratio[amax > 0] >= 4) & (ratio[amax > 0] < 8))


def test_requantize_preserves_any_values(rng):
    """Arbitrary (non-canonical) codes/scales: re-quantising their values gives the same values back."""
    codes = rng.integers(0, 256, (8, 48), dtype=np.uint8)
    scales = rng.integers(20, 230, (8, 3), dtype=np.uint8)
    w = mxfp4.dequantize_np(codes, scales)
    np.testing.assert_array_equal(mxfp4.dequantize_np(*mxfp4.quantize_np(w)), w)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_jnp_numpy_and_oracle_dequantize_identically(rng, dtype):
    E, out, inp = 2, 8, 32 * int(rng.integers(1, 5))
    codes = rng.integers(0, 256, (E, out, inp // 2), dtype=np.uint8)
    # e in [2, 252]: every product stays a normal number in fp32/bf16 (XLA on CPU flushes subnormals)
    scales = rng.integers(2, 253, (E, out, inp // 32), dtype=np.uint8)
    want = np.stack([ref.mxfp4_dequant(c, s) for c, s in zip(codes, scales, strict=True)])
    got_np = mxfp4.dequantize_np(codes, scales).astype(np.float64)
    got_jnp = np.asarray(mxfp4.dequantize(jnp.asarray(codes), jnp.asarray(scales), dtype)).astype(np.float64)
    for got in (got_np, got_jnp):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # -0 stays -0


def test_e2m1_values_by_arithmetic_equal_the_table():
    got = np.asarray(mxfp4.e2m1_values(jnp.arange(16, dtype=jnp.uint8)))
    np.testing.assert_array_equal(got, mxfp4.E2M1_VALUES)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(mxfp4.E2M1_VALUES))


def test_matvec_from_packed_codes_equals_the_dequantized_product(rng):
    """mxfp4.matvec (no dequantized copy) == float64 of the oracle's W @ x, to fp32 summation order."""
    T, k, out, inp = 3, int(rng.integers(1, 4)), 5, 32 * int(rng.integers(1, 5))
    codes = rng.integers(0, 256, (T, k, out, inp // 2), dtype=np.uint8)
    scales = rng.integers(100, 150, (T, k, out, inp // 32), dtype=np.uint8)
    x = rng.standard_normal((T, 1 if rng.integers(2) else k, inp)).astype(np.float32)
    x_bf16 = jnp.asarray(x, jnp.bfloat16)
    W = np.stack(
        [
            np.stack([ref.mxfp4_dequant(c, s) for c, s in zip(cc, ss, strict=True)])
            for cc, ss in zip(codes, scales, strict=True)
        ]
    )  # [T, k, out, in] float64
    want = np.einsum("tkoi,tki->tko", W, np.broadcast_to(np.asarray(x_bf16, np.float64), (T, k, inp)))
    got = np.asarray(mxfp4.matvec(x_bf16, jnp.asarray(codes), jnp.asarray(scales)), np.float64)
    assert got.shape == (T, k, out)
    scale = np.einsum("tkoi,tki->tko", np.abs(W), np.abs(np.broadcast_to(np.asarray(x_bf16, np.float64), (T, k, inp))))
    assert np.all(np.abs(got - want) <= 1e-6 * scale), np.max(np.abs(got - want) / scale)


def test_numpy_handles_the_smallest_scales_like_the_oracle(rng):
    """e = 0 means 2^-127 (OCP), not zero."""
    codes = rng.integers(0, 256, (4, 32), dtype=np.uint8)
    scales = rng.integers(0, 2, (4, 2), dtype=np.uint8)
    np.testing.assert_array_equal(
        mxfp4.dequantize_np(codes, scales).astype(np.float64), ref.mxfp4_dequant(codes, scales)
    )


def test_golden_nibble_order():
    """Codes 0..15 pack two per byte, low nibble first: 0x10, 0x32, ..., 0xFE (docs/model.md §7.2)."""
    golden = np.array([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2, np.uint8)[None]
    values = np.tile(np.concatenate([GRID, -GRID]), 2)[None].astype(np.float32)  # = E2M1(0..15) twice
    codes, scales = mxfp4.quantize_np(values)
    np.testing.assert_array_equal(codes, golden)
    np.testing.assert_array_equal(scales, [[127]])
    got_jnp = np.asarray(mxfp4.dequantize(golden, scales, jnp.float32))
    for got in (mxfp4.dequantize_np(golden, scales), got_jnp):
        np.testing.assert_array_equal(got, values)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(values))


def test_quantize_refuses_partial_groups(rng):
    with pytest.raises(ValueError, match="32"):
        mxfp4.quantize_np(rng.standard_normal((4, 48)))
