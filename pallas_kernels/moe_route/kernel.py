"""The router's top-k as one Mosaic GPU launch: a warp per token, 16 rounds of an exact argmax in registers.

Each warp holds its token's E biased scores in registers (E = 896: 28 per lane, 7 vectors of 4, read from
HBM by coalesced 16-byte loads; no SMEM, no TMA) and runs k rounds of: the maximum, the lowest index holding
it, the unbiased score at that index, then that entry removed. Every reduction is over one warp's lanes, so it
is a `redux.sync` (one instruction; no SMEM, no barrier): the three per round are int32 max reductions,
because the biased scores are compared as order-preserving int32 keys (the float's bits with the magnitude
flipped for negatives), the index as E-1-index (the max of those is the lowest index among ties), and the
unbiased score moves as its bits (one lane holds it, every other lane offers INT_MIN).

The int32 keys order the floats as IEEE total order (-0 below +0, NaN above +inf), which is what XLA's CPU
top_k compares by (`lax.top_k([-0., 0.], 1)` picks index 1); ties go to the lower index, like `lax.top_k`.
So `sel` equals `lax.top_k(biased, k)[1]` exactly, in the same order (largest first). Signed zeros and NaNs
are the only values where comparators can disagree (XLA's GPU TopK kernel compares floats with == and >, so
-0 == +0 there; bench/moe_route.py records what the GPU's top_k does), and neither arises from sigmoid
scores plus a finite bias: s + b is -0 only if s is. A removed entry becomes INT_MIN, the key of a negative
NaN with every payload bit set.

Launch: a warpgroup per 4 tokens (one CTA each, so T = 512 fills 128 of the 132 SMs). T % 4 leftover tokens
go to one CTA of 2 and/or 1 rows, whose warps hold a row each in pairs or all four (their reductions and
stores are the same, duplicated), so no row is computed or written twice and no padding is needed. At the
end each row's k ids and k weights are one vector per thread, stored from registers straight to HBM (64-byte
rows at k = 16; the warp's lanes write the same addresses).

The gathered form (route_gathered, tensor parallelism): the ranks' one all-gather returns a [T, ranks x W]
block whose rank pieces start with their E_l scores and E_l biased scores; two TMA boxes of [rows, ranks, E_l]
put them in SMEM, where they read as [rows, E] in expert order, and the rounds run as above. It replaces an
XLA slice kernel (~2 us at batch 1) between the gather and this launch.

No instruction here is Hopper-only (no WGMMA; the gathered form's TMA is sm90's and sm100's alike), so the same
body serves sm90 and sm100.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F32, I32 = jnp.float32, jnp.int32
VEC = 4  # fp32 per lane per load (16 bytes)
WIDTH = 32 * VEC  # a warp's span of one row per vector: E is padded to a multiple of it
ROWS = 4  # tokens per warpgroup (one per warp)
MAX_K = 32  # rounds are unrolled: more would only grow the kernel
INT_MIN = -(2**31)


def padded_experts(E: int) -> int:
    return -(-E // WIDTH) * WIDTH


def check_supported(scores_TE, biased_TE, bias_E, k):
    """NotImplementedError for what the kernel does not take (the api then runs the XLA reference)."""
    T, E = scores_TE.shape
    for name, a in (("scores", scores_TE), ("biased scores", biased_TE), ("bias", bias_E)):
        if a is not None and a.dtype != F32:
            raise NotImplementedError(f"fp32 router scores only (the spec's router is fp32), got {name} {a.dtype}")
    if not 1 <= k <= min(MAX_K, E):
        raise NotImplementedError(f"k = {k}: the kernel unrolls 1..{MAX_K} rounds (and k <= E = {E})")


def _layout(n):
    """n in (1, 2, 4) rows of [n, E]: row i on warp i (n = 4), on warps 2i, 2i+1 (n = 2) or on all four (n = 1);
    within a warp lane l holds entries 4l..4l+3 of every 128."""
    warps = {4: (-3,), 2: (-3, plgpu.Replicated(2)), 1: (plgpu.Replicated(4),)}[n]
    return plgpu.Layout.TILED(plgpu.Tiling(((n, WIDTH), (VEC,))), warp_dims=warps, lane_dims=(-2,), vector_dim=-1)


def _out_layout(n, k):
    """[n, k]: row i on the same warps as in _layout(n), its k values a vector in every lane of them."""
    warps = {4: (-2,), 2: (-2, plgpu.Replicated(2)), 1: (plgpu.Replicated(4),)}[n]
    lanes = (plgpu.Replicated(32),)
    return plgpu.Layout.TILED(plgpu.Tiling(((n, k),)), warp_dims=warps, lane_dims=lanes, vector_dim=-1)


def _order_key(x):
    """int32 keys whose signed order is the floats' total order: negative floats get their magnitude flipped."""
    bits = lax.bitcast_convert_type(x, I32)
    return bits ^ (lax.shift_right_arithmetic(bits, 31) & 0x7FFFFFFF)


def _select_rows(scores_ref, keys_ref, sel_ref, w_ref, start, n, *, k, E, biased, renormalize, scaling, src=None):
    """Rows start..start+n-1: their top-k ids and weights, straight to sel_ref / w_ref. src: the first of the
    n rows in scores_ref / keys_ref where they are not at start (the gathered form's SMEM copies: 0)."""
    layout = _layout(n)
    shape = (n, padded_experts(E))
    rows = pl.ds(start, n)
    src_rows = rows if src is None else pl.ds(src, n)

    def spread(v_n):  # a per-row value [n] back over its row [n, E]
        return plgpu.layout_cast(lax.broadcast_in_dim(v_n, shape, (0,)), layout)

    # From HBM into registers: 16-byte vector loads ("optimized" means an SMEM bank plan, not wanted here)
    s = plgpu.load(scores_ref.at[src_rows], layout=layout, optimized=False)
    if biased:
        b = plgpu.load(keys_ref.at[src_rows], layout=layout, optimized=False)
    else:  # keys_ref is the bias [1, E]: the same fp32 add XLA does
        bias = plgpu.load(keys_ref.at[0], layout=layout.reduce(0), optimized=False)
        b = s + plgpu.layout_cast(lax.broadcast_in_dim(bias, shape, (1,)), layout)
    key = _order_key(b)
    s_bits = lax.bitcast_convert_type(s, I32)
    rev = (shape[1] - 1) - plgpu.broadcasted_iota(I32, shape, 1, layout=layout)  # max of rev = lowest index
    sels, ws = [], []
    for r in range(k):
        best = jnp.max(key, axis=1)
        rev_r = jnp.max(jnp.where(key == spread(best), rev, -1), axis=1)
        hit = rev == spread(rev_r)
        sels.append((shape[1] - 1) - rev_r)
        ws.append(lax.bitcast_convert_type(jnp.max(jnp.where(hit, s_bits, INT_MIN), axis=1), F32))
        if r + 1 < k:  # the removed entry (the kept keys as the select's first case: a constant there would
            key = jnp.where(~hit, key, INT_MIN)  # make Mosaic's result unsigned, and the next max a maxui)
    # The k results per row as one [n, k] array, a row's k values in each thread's registers (a 1-element store
    # of a tiled array does not lower in jax 0.11.2, so n = 1 cannot store per round).
    out = _out_layout(n, k)
    col = plgpu.broadcasted_iota(I32, (n, k), 1, layout=out)

    def gather(vals):
        row = lambda v: plgpu.layout_cast(lax.broadcast_in_dim(v, (n, k), (0,)), out)  # noqa: E731
        return functools.reduce(lambda acc, r: jnp.where(col == r, row(vals[r]), acc), range(1, k), row(vals[0]))

    w = gather(ws)
    if renormalize and k > 1:  # as the reference: w / (sum + 1e-20), then the scaling factor
        total = functools.reduce(lambda a, c: a + c, ws) + 1e-20
        w = w / plgpu.layout_cast(lax.broadcast_in_dim(total, (n, k), (0,)), out)
    sel_ref.at[rows][...] = gather(sels)
    w_ref.at[rows][...] = w * scaling


def _tail_pieces(T):
    """(start, rows) of the CTAs after the T // 4 full ones: T % 4 as 2 and/or 1 rows."""
    start, pieces = T - T % ROWS, []
    for n in (2, 1):
        if (T - start) >= n:
            pieces.append((start, n))
            start += n
    return tuple(pieces)


def _for_this_cta(T, run):
    """run(start, n) on this CTA's rows: 4 for each of the T // 4 full CTAs, then the tail pieces' 2 or 1."""
    blk = lax.axis_index("blk")
    n_full = T // ROWS
    if n_full:
        pl.when(blk < n_full)(lambda: run(blk * ROWS, ROWS))
    for i, (start, n) in enumerate(_tail_pieces(T)):
        pl.when(blk == n_full + i)(functools.partial(run, start, n))


def _launch(body, T, k, *, scratch=(), interpret=None):
    """The kernel over T rows (a CTA per 4, and the tail pieces) -> (sel [T, k] int32, w [T, k] fp32)."""
    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((T, k), I32), jax.ShapeDtypeStruct((T, k), F32)),
        scratch_types=list(scratch),
        grid=(T // ROWS + len(_tail_pieces(T)),),
        grid_names=("blk",),
        kernel_name="moe_route_topk",  # what CUPTI traces call it
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )


def _body(scores_ref, keys_ref, sel_ref, w_ref, *, T, **kw):
    _for_this_cta(T, functools.partial(_select_rows, scores_ref, keys_ref, sel_ref, w_ref, **kw))


@functools.partial(jax.jit, static_argnames=("k", "renormalize", "scaling", "interpret"))
def route(scores_TE, biased_TE=None, bias_E=None, *, k, renormalize=True, scaling=1.0, interpret=None):
    """-> (sel [T, k] int32, w [T, k] fp32): lax.top_k(biased, k)'s indices and the unbiased scores there,
    renormalised (w / (sum + 1e-20), where renormalize and k > 1) and times scaling. Give the biased scores
    [T, E], or the bias [E] (added in the kernel, as XLA would)."""
    check_supported(scores_TE, biased_TE, bias_E, k)
    if (biased_TE is None) == (bias_E is None):
        raise ValueError("give exactly one of biased_TE (scores + bias, [T, E]) or bias_E ([E])")
    T, E = scores_TE.shape
    keys = biased_TE if bias_E is None else bias_E[None]
    if padded_experts(E) != E:  # small test shapes only (E = 896 is 7 x 128): pads never win a slot
        pad = padded_experts(E) - E
        scores_TE = jnp.pad(scores_TE, ((0, 0), (0, pad)))
        keys = jnp.pad(keys, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    body = functools.partial(
        _body, T=T, k=k, E=E, biased=bias_E is None, renormalize=renormalize, scaling=float(scaling)
    )
    return _launch(body, T, k, interpret=interpret)(scores_TE, keys)


# ------------------------------------------------------------------------------- from the gathered routing block
def check_gathered(block_TX, ranks: int, e_local: int, k: int):
    """NotImplementedError where the gathered form cannot run: its TMA box [rows, ranks, E_l] needs E_l fp32 a
    multiple of 16 bytes and at most 256 (TP2's 448 is not), and the E = ranks x E_l scores a whole number of
    the warp's 128-wide spans (E = 896 at TP4 / 8 / 16)."""
    T, X = block_TX.shape
    if block_TX.dtype != F32:
        raise NotImplementedError(f"fp32 routing blocks only, got {block_TX.dtype}")
    if e_local % 4 or e_local > 256 or ranks > 256:
        raise NotImplementedError(f"E_l = {e_local} experts a rank: the TMA box takes multiples of 4 up to 256")
    if (ranks * e_local) % WIDTH:
        raise NotImplementedError(f"E = {ranks} x {e_local}: the gathered form needs a multiple of {WIDTH}")
    if not 1 <= k <= min(MAX_K, ranks * e_local):
        raise NotImplementedError(f"k = {k}: the kernel unrolls 1..{MAX_K} rounds")


def _body_gathered(block_ref, sel_ref, w_ref, s_smem, b_smem, bar, *flat, T, ranks, e_local, **kw):
    """A CTA's rows of the gathered block [T, ranks, W]: each rank's scores and biased scores ([rows, ranks,
    E_l] boxes, one TMA each) land in SMEM, which read as [rows, E] is expert order; then _select_rows as the
    plain form. flat: interpret mode's [ROWS, E] copies (it takes no reshaped ref; the same bytes by copies)."""
    E = ranks * e_local

    def run(start, n):
        rows, mine = block_ref.at[pl.ds(start, n)], pl.ds(0, n)
        plgpu.copy_gmem_to_smem(rows.at[:, :, pl.ds(0, e_local)], s_smem.at[mine], bar)
        plgpu.copy_gmem_to_smem(rows.at[:, :, pl.ds(e_local, e_local)], b_smem.at[mine], bar)
        plgpu.barrier_wait(bar)
        if flat:
            for src, dst in zip((s_smem, b_smem), flat, strict=True):
                for r in range(ranks):
                    dst[mine, pl.ds(r * e_local, e_local)] = src[mine, r, :]
            s_rows, b_rows = flat
        else:
            s_rows, b_rows = s_smem.reshape(ROWS, E), b_smem.reshape(ROWS, E)
        _select_rows(s_rows, b_rows, sel_ref, w_ref, start, n, src=0, **kw)

    _for_this_cta(T, run)


@functools.partial(jax.jit, static_argnames=("ranks", "e_local", "k", "renormalize", "scaling", "interpret"))
def route_gathered(block_TX, *, ranks, e_local, k, renormalize=True, scaling=1.0, interpret=None):
    """route() on the routing block the ranks' all-gather returns, [T, ranks x W], each rank's W-wide piece
    starting with its E_l scores then its E_l biased scores (expert r E_l + j at piece r's j): the kernel reads
    both straight from the block (no XLA slice kernel before it). -> (sel [T, k] int32, w [T, k] fp32)."""
    check_gathered(block_TX, ranks, e_local, k)
    T, X = block_TX.shape
    E = ranks * e_local
    body = functools.partial(
        _body_gathered,
        T=T,
        ranks=ranks,
        e_local=e_local,
        k=k,
        E=E,
        biased=True,
        renormalize=renormalize,
        scaling=float(scaling),
    )
    scratch = [plgpu.SMEM((ROWS, ranks, e_local), F32)] * 2 + [plgpu.Barrier(num_arrivals=2)]
    scratch += [plgpu.SMEM((ROWS, E), F32)] * (2 if interpret is not None else 0)
    kernel = _launch(body, T, k, scratch=scratch, interpret=interpret)
    return kernel(block_TX.reshape(T, ranks, X // ranks))
