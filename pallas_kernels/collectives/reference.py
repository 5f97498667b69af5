"""XLA versions of the collectives: the fallback path and the test oracle.

The all-reduce functions run inside `jax.shard_map` and reduce over `axis_name`. The layer-boundary maths they
fuse (attn_res, rms_norm, mix_norm) is also what the model's XLA path runs (k3jax/layers/boundary.py): one
implementation for both.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.common import round_to

F32 = jnp.float32


def all_reduce(x, axis_name="tp"):
    """Plain psum (NCCL on GPU)."""
    return jax.lax.psum(x, axis_name)


def rms_norm(x, w, eps):
    """HF/NeMo RMSNorm over the last axis: fp32 statistics, the normalised value rounded to x's dtype, then a
    multiply by w in that dtype."""
    xf = x.astype(F32)
    return round_to(xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps), x.dtype) * w.astype(x.dtype)


def attn_res(sources, norm_w, proj_w, eps, return_weights=False):
    """Attention Residuals (docs/model.md §2.1): a softmax over depth of the sources (the stored blocks in storage
    order, then the live prefix P; a sequence, or an array stacked on its leading axis) with scores
    rsqrt(mean(v^2) + eps) * (v . q), q = norm_w * proj_w (only the product enters). fp32 end to end (no bf16
    round trip of the normalised keys), one rounding to the sources' dtype. -> mix (, weights [N, ...])."""
    dtype = sources[0].dtype
    v = jnp.stack([s.astype(F32) for s in sources])  # [N, ..., D]
    q = norm_w.astype(F32) * proj_w.astype(F32)
    hp = jax.lax.Precision.HIGHEST
    alpha = jax.nn.softmax(
        jax.lax.rsqrt(jnp.mean(v * v, axis=-1) + eps) * jnp.einsum("n...d,d->n...", v, q, precision=hp), axis=0
    )
    out = round_to(jnp.einsum("n...,n...d->...d", alpha, v, precision=hp), dtype)
    return (out, alpha) if return_weights else out


def add_rmsnorm(s_f32, residual, norm_w, eps):
    """new = round(residual + s); normed = RMSNorm(new) * w (docs/model.md §1.5)."""
    new = (residual.astype(F32) + s_f32).astype(residual.dtype)
    return new, rms_norm(new, norm_w, eps)


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


def mix_norm(a, prefix, blocks, res_norm_w, res_proj_w, norm_w, eps, return_weights=False):
    """A layer boundary after an all-reduce (docs/model.md §2.1-2.3), with a = the all-reduced sublayer output:
    P' = a (no prefix: block boundary) or round(P + a); h = attn_res(blocks + [P']) (P' without blocks; blocks
    is a sequence of arrays shaped like a, or None); returns (P', rms_norm(h, w)), and the AttnRes weights
    (None without blocks) if return_weights."""
    new = a if prefix is None else (prefix.astype(F32) + a.astype(F32)).astype(a.dtype)
    h, alpha = new, None
    if blocks:
        h, alpha = attn_res([*blocks, new], res_norm_w, res_proj_w, eps, return_weights=True)
    out = (new, rms_norm(h, norm_w, eps))
    return (*out, alpha) if return_weights else out


def all_reduce_mix_norm(x_partial, prefix, blocks, res_norm_w, res_proj_w, norm_w, eps, axis_name="tp"):
    """mix_norm after an fp32 psum of the partials rounded once to their dtype (what the Pallas all-reduce
    returns)."""
    a = round_to(jax.lax.psum(x_partial.astype(jnp.float32), axis_name), x_partial.dtype)
    return mix_norm(a, prefix, blocks, res_norm_w, res_proj_w, norm_w, eps)
