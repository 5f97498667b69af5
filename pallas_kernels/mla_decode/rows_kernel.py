"""The MLA layer's new cache rows as one Mosaic GPU launch, written into the cache in place.

What XLA runs as ~5 kernels per MLA layer in decode (the kv norm, the row's concat, the two scale reductions, two
scatters into the cache; 8.8 us with the q_a norm at batch 1 on the H200, bench/NOTES.md lever 3) is one CTA per
new token here: its kv_a output [R + E] is read once, c = kv[:R] normalised (the model's RMSNorm: fp32
statistics, rounded to the activation dtype, times the weight in it), and the row [c | k_pe] stored at the
token's position, quantised by the FP8 row rule (reference.quantize_rows: one fp32 scale per part, max|x| /
448) or as is for a bf16 cache. The cache's rows and scales go in as refs the kernel writes (jax.new_ref), so its
call aliases them: a donated cache is updated in place, as XLA's scatters did (no copy of the cache).

c is a [1, R] row over a warp's lanes (4 values a lane, R a multiple of 128) and k_pe a [1, E] row (2 a lane,
E = 64), each on all four warps of the warpgroup alike (the work is a few hundred values: the four warps' stores
are the same); a token that is not valid, or whose position is past the cache, writes nothing. Nothing here is
Hopper-only: the same kernel serves sm90 and sm100.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mla_decode.reference import FP8, FP8_MAX

F32 = jnp.float32


def _row_layout(n):
    """[1, n]: a warp's lanes hold n / 32 values each (vectors of 4, or 2 for n = 64), every warp the same."""
    vec = 4 if n % 128 == 0 else 2
    tiling = plgpu.Tiling(((1, 32 * vec), (vec,)))
    return plgpu.Layout.TILED(tiling, warp_dims=(plgpu.Replicated(4),), lane_dims=(-2,), vector_dim=-1)


def check_supported(kv_BTC, kv_norm_w_R, entry):
    """NotImplementedError for what the kernel does not take (the api then runs the reference)."""
    R, C = kv_norm_w_R.shape[0], kv_BTC.shape[-1]
    if R % 128 or (C - R) not in (64,) or C % 16:
        raise NotImplementedError(f"rows of R = {R} (a multiple of 128) + E = {C - R} (64): got {C}")
    if kv_BTC.dtype not in (jnp.bfloat16, F32):
        raise NotImplementedError(f"activations in {kv_BTC.dtype}: bf16 or float32")
    rows = entry["rows"]
    if rows.dtype not in (FP8, jnp.bfloat16, F32) or ("scales" in entry) != (rows.dtype == FP8):
        raise NotImplementedError(f"a cache of {rows.dtype} rows {'with' if 'scales' in entry else 'without'} scales")


def _body(pos_ref, valid_ref, kv_ref, w_ref, rows_ref, *scales_ref, R, eps):
    """Token t of sequence b: pos, valid [B, T] int32, kv [B, T, C], the norm weight [1, R]; rows [B, S, C]
    (and fp8's scales [B, S, 2]) written in place at row pos[b, t]."""
    b, t = lax.axis_index("b"), lax.axis_index("t")
    S, C = rows_ref.shape[1:]
    E = C - R
    dtype = kv_ref.dtype
    c_l, e_l = _row_layout(R), _row_layout(E)
    token = kv_ref.at[b, pl.ds(t, 1)]  # [1, C]
    c = plgpu.load(token.at[:, pl.ds(0, R)], layout=c_l, optimized=False).astype(F32)
    k_pe = plgpu.load(token.at[:, pl.ds(R, E)], layout=e_l, optimized=False)
    w = plgpu.load(w_ref, layout=c_l, optimized=False).astype(dtype)  # [1, R]
    p = pos_ref[b, t]
    write = (valid_ref[b, t] != 0) & (p >= 0) & (p < S)

    def spread(v, layout, n):  # a row's scalar [1] back over the row [1, n]
        return plgpu.layout_cast(lax.broadcast_in_dim(v, (1, n), (0,)), layout)

    inv = lax.rsqrt(jnp.sum(c * c, axis=1) / R + eps)  # the mean as jnp.mean: the sum over R
    c = (c * spread(inv, c_l, R)).astype(dtype) * w

    def store():
        row = rows_ref.at[b, pl.ds(p, 1)]  # [1, C]
        if scales_ref:
            for part, (v, n, lo) in enumerate(((c, R, 0), (k_pe, E, R))):
                v = v.astype(F32)
                scale = jnp.maximum(jnp.max(jnp.max(jnp.abs(v), axis=1), axis=0) / FP8_MAX, 1e-30)  # a scalar
                row.at[:, pl.ds(lo, n)][...] = (v / scale).astype(FP8)
                scales_ref[0][b, p, part] = scale
        else:
            row.at[:, pl.ds(0, R)][...] = c.astype(rows_ref.dtype)
            row.at[:, pl.ds(R, E)][...] = k_pe.astype(rows_ref.dtype)

    pl.when(write)(store)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def write_rows(kv_BTC, kv_norm_w_R, entry, pos_BT, valid_BT, *, eps, interpret=None):
    """reference.mla_write_rows as one launch -> the new entry (its arrays updated in place where the caller
    donates them)."""
    check_supported(kv_BTC, kv_norm_w_R, entry)
    B, T, _ = kv_BTC.shape
    refs = {k: jax.new_ref(v) for k, v in entry.items()}
    kernel = plgpu.kernel(
        functools.partial(_body, R=kv_norm_w_R.shape[0], eps=eps),
        out_type=(),
        grid=(B, T),
        grid_names=("b", "t"),
        kernel_name="mla_write_rows",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )
    kernel(
        pos_BT.astype(jnp.int32),
        valid_BT.astype(jnp.int32),
        kv_BTC,
        kv_norm_w_R[None],  # in its dtype (a bitcast): an fp32 copy was an XLA kernel of its own a layer
        refs["rows"],
        *([refs["scales"]] if "scales" in refs else []),
    )
    return {k: r[...] for k, r in refs.items()}
