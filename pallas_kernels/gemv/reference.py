"""The XLA form of the decode GEMV, and the numerics the kernel must match: one fp32 sum per output, rounded
once to the activation dtype (the model's GEMM rule, pallas_kernels.common.dot), or kept in fp32 where asked
(the MoE router's logits)."""

import contextlib

import jax
import jax.numpy as jnp

from pallas_kernels.common import dot

F32 = jnp.float32


def out_dtypes_for(x_BD, ws_ND, out_dtypes=None) -> tuple:
    """Each output's dtype: x's (the default) or fp32; anything else is a caller's error."""
    x_dtype = jnp.dtype(x_BD.dtype)
    dtypes = tuple(jnp.dtype(d) for d in out_dtypes) if out_dtypes is not None else (x_dtype,) * len(ws_ND)
    if len(dtypes) != len(ws_ND) or any(d not in (x_dtype, jnp.dtype(F32)) for d in dtypes):
        raise ValueError(f"out_dtypes {dtypes}: one per weight ({len(ws_ND)}), each x's dtype {x_dtype} or float32")
    return dtypes


def gemv(x_BD, ws_ND, out_dtypes=None, names=None):
    """x [B, D] times each out-major weight [N_i, D] -> tuple of [B, N_i] in out_dtypes (default x's dtype). An
    fp32 output is the sum of the operands widened to fp32, at Precision.HIGHEST, unrounded: the MoE router's
    logits (bf16 products are exact in fp32). names: a jax.named_scope per output (the HLO op names a profile
    attributes kernels by: every output's einsum is "bd,nd->bn" otherwise)."""
    outs = []
    dtypes = out_dtypes_for(x_BD, ws_ND, out_dtypes)
    for w, dtype, name in zip(ws_ND, dtypes, names or (None,) * len(ws_ND), strict=True):
        with jax.named_scope(name) if name else contextlib.nullcontext():
            if dtype == F32:
                x32, w32 = x_BD.astype(F32), w.astype(F32)
                outs.append(jnp.einsum("bd,nd->bn", x32, w32, precision=jax.lax.Precision.HIGHEST))
            else:
                outs.append(dot("bd,nd->bn", x_BD, w.astype(x_BD.dtype)).astype(x_BD.dtype))
    return tuple(outs)


def x_windows(xs_BK, ws_NK, x_starts=None):
    """The x_j gemv_sum multiplies: x_j itself where x_starts[j] is None (or no x_starts), else its K_j columns
    from x_starts[j] on (K_j = w_j's; a traced start: a rank's slice of a replicated activation, e.g.
    axis_index x K_j)."""
    starts = x_starts or (None,) * len(xs_BK)
    return tuple(
        x if x0 is None else jax.lax.dynamic_slice_in_dim(x, x0, w.shape[1], axis=1)
        for x, w, x0 in zip(xs_BK, ws_NK, starts, strict=True)
    )


def gemv_sum(xs_BK, ws_NK, names=None, x_starts=None):
    """Σ_j x_j [B, K_j] @ w_jᵀ (w_j out-major [N, K_j]) -> [B, N] in x's dtype, as the model writes a sum of
    projections (docs/model.md §6 step 5, the MoE's y_rout + y_sh): each product the GEMM rule (an fp32 sum
    rounded to x's dtype), then the rounded products added in order in x's dtype. names: a jax.named_scope per
    product (its HLO op name, which a profile attributes kernels by). x_starts: x_windows'."""
    y = None
    xs_BK = x_windows(xs_BK, ws_NK, x_starts)
    for x, w, name in zip(xs_BK, ws_NK, names or (None,) * len(ws_NK), strict=True):
        with jax.named_scope(name) if name else contextlib.nullcontext():
            p = dot("bk,nk->bn", x, w.astype(x.dtype)).astype(x.dtype)
        y = p if y is None else y + p
    return y
