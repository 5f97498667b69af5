"""XLA versions of the collectives: the fallback path and the test oracle.

All functions run inside `jax.shard_map` and reduce over `axis_name`.
"""

import jax
import jax.numpy as jnp


def all_reduce(x, axis_name="tp"):
  """Plain psum (NCCL on GPU)."""
  return jax.lax.psum(x, axis_name)


def add_rmsnorm(s_f32, residual, norm_w, eps):
  """new = round(residual + s); normed = round(round(new * rsqrt(mean(new^2) + eps)) * w) (K3_SPEC 1)."""
  new = (residual.astype(jnp.float32) + s_f32).astype(residual.dtype)
  new_f32 = new.astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.mean(new_f32 * new_f32, axis=-1, keepdims=True) + eps)
  # HF/NeMo order: normalise in fp32, round to the activation dtype, then a bf16 multiply by w.
  normed = ((new_f32 * inv).astype(residual.dtype).astype(jnp.float32) * norm_w.astype(jnp.float32))
  return new, normed.astype(residual.dtype)


def all_reduce_add_rmsnorm(x_partial, residual, norm_w, eps, axis_name="tp"):
  """(residual + psum(x_partial), RMSNorm(that) * w); the sum is kept in fp32 until the residual add."""
  s = jax.lax.psum(x_partial.astype(jnp.float32), axis_name)
  return add_rmsnorm(s, residual, norm_w, eps)


def proj_all_reduce(x_BK, w_KD, residual_BD=None, axis_name="tp"):
  """Row-parallel projection + all-reduce (+ residual): the local GEMM in FP32, psum of the FP32 partials,
  the residual added in FP32, one rounding to residual's dtype (x's without a residual)."""
  s = jax.lax.psum(jnp.dot(x_BK, w_KD, preferred_element_type=jnp.float32), axis_name)
  if residual_BD is None:
    return s.astype(x_BK.dtype)
  return (residual_BD.astype(jnp.float32) + s).astype(residual_BD.dtype)
