"""XLA versions of the collectives: the fallback path and the test oracle.

All functions run inside `jax.shard_map` and reduce over `axis_name`.
"""

import jax
import jax.numpy as jnp


def round_to(x_f32, dtype):
  """x rounded to dtype, and kept rounded: XLA GPU's excess-precision pass drops a convert pair
  f32 -> bf16 -> f32, so a rounding that later fp32 maths reads goes through reduce_precision, which it keeps."""
  info = jnp.finfo(dtype)
  return jax.lax.reduce_precision(x_f32, info.nexp, info.nmant).astype(dtype)


def all_reduce(x, axis_name="tp"):
  """Plain psum (NCCL on GPU)."""
  return jax.lax.psum(x, axis_name)


def add_rmsnorm(s_f32, residual, norm_w, eps):
  """new = round(residual + s); normed = round(round(new * rsqrt(mean(new^2) + eps)) * w) (K3_SPEC 1)."""
  new = (residual.astype(jnp.float32) + s_f32).astype(residual.dtype)
  new_f32 = new.astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.mean(new_f32 * new_f32, axis=-1, keepdims=True) + eps)
  # HF/NeMo order: normalise in fp32, round to the activation dtype, then a bf16 multiply by w.
  normed = round_to(new_f32 * inv, residual.dtype).astype(jnp.float32) * norm_w.astype(jnp.float32)
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


def mix_norm(a, prefix, blocks, res_norm_w, res_proj_w, norm_w, eps):
  """A layer boundary after an all-reduce (K3_SPEC §2.1-2.3), with a = the all-reduced sublayer output:
  P' = a (no prefix: block boundary) or round(P + a); h = AttnRes(blocks + [P']) (P' without blocks; blocks is
  a sequence of arrays shaped like a, or None); returns (P', RMSNorm(h) * w). AttnRes in fp32 with one
  rounding; HF RMSNorm order (w in h's dtype)."""
  dtype = a.dtype
  new = a if prefix is None else (prefix.astype(jnp.float32) + a.astype(jnp.float32)).astype(dtype)
  if not blocks:
    h = new
  else:
    v = jnp.stack([b.astype(jnp.float32) for b in (*blocks, new)])  # [N + 1, ..., D]
    q = res_norm_w.astype(jnp.float32) * res_proj_w.astype(jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    score = jax.lax.rsqrt(jnp.mean(v * v, axis=-1) + eps) * jnp.einsum("n...d,d->n...", v, q, precision=hp)
    alpha = jax.nn.softmax(score, axis=0)
    h = round_to(jnp.einsum("n...,n...d->...d", alpha, v, precision=hp), dtype)
  hf = h.astype(jnp.float32)
  n = round_to(hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps), dtype)
  return new, n * norm_w.astype(dtype)


def all_reduce_mix_norm(x_partial, prefix, blocks, res_norm_w, res_proj_w, norm_w, eps, axis_name="tp"):
  """mix_norm after an fp32 psum of the partials rounded once to their dtype (what the Pallas all-reduce
  returns)."""
  a = round_to(jax.lax.psum(x_partial.astype(jnp.float32), axis_name), x_partial.dtype)
  return mix_norm(a, prefix, blocks, res_norm_w, res_proj_w, norm_w, eps)
