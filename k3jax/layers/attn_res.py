"""Attention Residuals (K3_SPEC §2.1): softmax over depth sources with a learned pseudo-query.

Sources are the stored block representations plus the live prefix P, stacked on a leading axis. fp32 from
end to end (no bf16 round trip of the normalised keys), one rounding at the end.
"""

import jax
import jax.numpy as jnp

F32 = jnp.float32


def attn_res(sources_N, norm_w, proj_w, eps, return_weights: bool = False):
    """sources_N: [N, ..., D] (blocks in storage order, then P). Returns the mix in the sources' dtype."""
    v = sources_N.astype(F32)
    q_D = norm_w.astype(F32) * proj_w.astype(F32)  # only the product a*p matters
    r = jax.lax.rsqrt(jnp.mean(v * v, axis=-1) + eps)  # [N, ...]
    s = r * jnp.einsum("n...d,d->n...", v, q_D, precision=jax.lax.Precision.HIGHEST)
    alpha = jax.nn.softmax(s, axis=0)
    out = jnp.einsum("n...,n...d->...d", alpha, v, precision=jax.lax.Precision.HIGHEST).astype(sources_N.dtype)
    return (out, alpha) if return_weights else out
