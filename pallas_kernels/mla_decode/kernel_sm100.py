"""MLA decode attention over the latent cache as one Mosaic GPU kernel for Blackwell (tcgen05 MMAs, accumulators in
TMEM), plus kernel.py's XLA combine. Not run on a GPU yet (no Blackwell here): interpret-tested on CPU and lowered
for CUDA under an abstract B200.

The form is kernel.py's (its docstring has the reasons): positions on the MMA's M, the (token, head) columns of a
head group on N, flash-decoding splits over each sequence's own valid blocks, the last block overlapping its
predecessor instead of leaving the cache, fp8 e4m3 rows converted to f16 with their per-row scales applied in fp32
(the c and k_pe scores in two accumulators, c's scale folded into P), f16 queries scaled per column by a power of
two, fp32 online softmax (exp2), float32 compute as 3 pieces per operand (kernel._q_pieces cuts q's in XLA, P's
are cut here). What Blackwell changes:
- tcgen05's M is 128 (M = 64 has layout restrictions in Mosaic GPU 0.11.2), so a block is 128 positions: the
  scores S^T [128, N] = rows [128, C] · q^T, and O^T [R, N] as R / 128 row tiles [128, N], tile k += c[:, 128 k ..
  128 k + 127]^T · P^T. N is a multiple of 16 (tcgen05's N at M = 128).
- The accumulators live in TMEM: the scores ([128, N] for bf16 rows; c's and k_pe's side by side for fp8) and a
  fresh P·V accumulator per block (R / 128 tiles of N columns), at most 512 columns in all. The running O^T stays
  in registers (R / 128 x N fp32 a thread, in tcgen05.ld's layout): acc = acc x alpha + the block's P·V, read
  back by tcgen05.ld. This is kernel.py's "add" form; the "state" form (O^T accumulated in TMEM, rescaled there
  through tcgen05.st) is left out.
- tcgen05 reads its operands from SMEM (or A from TMEM), never from registers: fp8 rows are converted in chunks
  of 128 positions x 128 columns (k_pe: 64) into a ring of two f16 tiles, so converting chunk j + 1 overlaps the
  MMA of chunk j (each chunk's MMAs arrive on its tile's barrier, waited before the tile is rewritten). A whole
  converted block (128 x 576 f16, 144 KiB) does not fit beside its fp8 TMA slot and the queries, so P·V converts
  the c chunks a second time (ALU work against SMEM: the first form, not measured).
- SMEM bounds the stages: a bf16 block is 144 KiB and an fp8 one 72 KiB, so at R = 512 one TMA slot fits
  (pick_launch lowers tuning.json's stages to what fits); the slot is refilled once the block's last reader is
  done (fp8: its last conversion; bf16: its last P·V MMA).
Left out against kernel.py: the "state" accumulation, the qk_regs variant (tcgen05 takes no register operand).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mla_decode import kernel
from pallas_kernels.mla_decode.kernel import F16, F32, FP8

BLOCK = 128  # positions per block: tcgen05's M
CHUNK = 128  # columns per MMA chunk: one O^T row tile (its M), one converted f16 tile
COL_STEP = 16  # tcgen05's N granularity at M = 128
TMEM_COLS = 512  # 32-bit TMEM columns per CTA
SMEM_BYTES = 227 * 1024  # sm100's per-CTA maximum (as sm90's)
ROW = plgpu.Layout.TCGEN05.reduce(1)  # a value per row of a [128, N] tile (per position)
COL = plgpu.Layout.TCGEN05.reduce(0)  # a value per column (per (token, head))


@dataclasses.dataclass(frozen=True)
class Launch:
    """How a call is laid out (pick_launch)."""

    heads_per_group: int  # Hg: a CTA's heads (its columns are T x Hg)
    cols: int  # N = T x Hg padded to COL_STEP
    splits: int  # CTAs per (sequence, head group) along the context
    stages: int  # TMA slots in flight


def tmem_cols(R, cols, row_dtype) -> int:
    """TMEM columns: the scores (two accumulators for fp8) and the block's P·V tiles."""
    return ((2 if jnp.dtype(row_dtype) == FP8 else 1) + R // CHUNK) * cols


def smem_bytes(R, E, cols, stages, row_dtype, compute_dtype) -> int:
    """The kernel's SMEM as Pallas lays it out: each scratch buffer rounded up to 1 KiB, 2 KiB for cross-warp
    reductions, 1 KiB for the barriers."""
    P, rb, fp8 = kernel.pieces(compute_dtype), jnp.dtype(row_dtype).itemsize, jnp.dtype(row_dtype) == FP8
    buffers = [2 * P * cols * R, 2 * P * cols * E, stages * BLOCK * R * rb, stages * BLOCK * E * rb]
    buffers += [2 * 2 * BLOCK * CHUNK] if fp8 else []  # the ring of converted f16 tiles
    buffers += [2 * P * cols * BLOCK]  # P^T pieces
    return sum(-(-n // 1024) * 1024 for n in buffers) + 2048 + 1024


def check_supported(q_lat_BTHR, q_pe_BTHE, rows_BSC, scales_BS2, launch: Launch):
    kernel.check_inputs(q_lat_BTHR, q_pe_BTHE, rows_BSC, scales_BS2)
    R, E, S = q_lat_BTHR.shape[-1], q_pe_BTHE.shape[-1], rows_BSC.shape[1]
    if R % CHUNK or E % 64 or E > CHUNK:
        raise NotImplementedError(f"R = {R}, E = {E}: R a multiple of {CHUNK}, E of 64 up to {CHUNK}")
    if S < BLOCK:
        raise NotImplementedError(f"a cache of {S} positions: the kernel reads whole blocks of {BLOCK}")
    if launch.cols % COL_STEP or launch.cols > 256:
        raise NotImplementedError(f"{launch.cols} columns: tcgen05's N, a multiple of {COL_STEP} up to 256")
    if (need := tmem_cols(R, launch.cols, rows_BSC.dtype)) > TMEM_COLS:
        raise NotImplementedError(f"{launch.cols} columns need {need} TMEM columns (> {TMEM_COLS})")
    need = smem_bytes(R, E, launch.cols, launch.stages, rows_BSC.dtype, q_lat_BTHR.dtype)
    if need > SMEM_BYTES:
        raise NotImplementedError(f"{launch.stages} stages need {need} bytes of SMEM (> {SMEM_BYTES})")


def pick_launch(tuning: dict, B, T, H, R, E, S, row_dtype, compute_dtype) -> Launch:
    """tuning.json's sm100 entry -> the launch for this call. Head groups: the most heads whose T x Hg columns fit
    max_cols (registers: O^T is R / 128 x N fp32 per thread), TMEM and, with one stage, SMEM; stages: the entry's,
    lowered to what SMEM holds. Splits: kernel.split_count, over blocks of 128."""
    want = tuning["stages"]["fp8" if jnp.dtype(row_dtype) == FP8 else "bf16"]

    def cols_for(hg):
        return -(-T * hg // COL_STEP) * COL_STEP

    def fits(cols, stages):
        return (
            smem_bytes(R, E, cols, stages, row_dtype, compute_dtype) <= SMEM_BYTES
            and tmem_cols(R, cols, row_dtype) <= TMEM_COLS
        )

    groups = [d for d in range(H, 0, -1) if H % d == 0 and T * d <= max(tuning["max_cols"], T)]
    Hg = next((d for d in groups if fits(cols_for(d), 1)), groups[-1])
    N = cols_for(Hg)
    stages = next((s for s in range(want, 0, -1) if fits(N, s)), 1)
    splits = kernel.split_count(tuning, B * (H // Hg), S, BLOCK)
    return Launch(heads_per_group=Hg, cols=N, splits=splits, stages=stages)


def _mma_chunks(chunks, conv_s, done):
    """Issue one phase's MMAs and wait for them. chunks: [(raw [128, w] SMEM ref, mmas)], mmas(a) issuing the
    chunk's MMAs with a its rows in the MMA type. conv_s (fp8; None for bf16 rows): the ring of two f16 tiles, chunk
    j converted into tile j % 2 once the MMAs that read it two chunks ago have arrived on done[j % 2]."""
    if conv_s is None:
        for raw, mmas in chunks:
            mmas(raw)
        plgpu.tcgen05_commit_arrive(done.at[0])
        plgpu.barrier_wait(done.at[0])
        return
    for j, (raw, mmas) in enumerate(chunks):
        slot = j % 2
        if j >= 2:
            plgpu.barrier_wait(done.at[slot])
        a = conv_s.at[slot, :, pl.ds(0, raw.shape[1])]
        for k0 in range(0, raw.shape[1], 64):  # 64 columns at a time: registers stay few
            cols = pl.ds(k0, 64)
            a.at[:, cols][...] = kernel.load_fp8_tile(raw.at[:, cols]).astype(F16)
        plgpu.commit_smem()  # the tensor core (async proxy) reads what every thread wrote
        mmas(a)
        plgpu.tcgen05_commit_arrive(done.at[slot])
    for j in range(max(0, len(chunks) - 2), len(chunks)):
        plgpu.barrier_wait(done.at[j % 2])


def _body(lens_ref, colscale_ref, q_ref, rows_ref, *refs, fp8, P, R, E, N, T, Hg, stages, splits):
    """kernel._body's contract: lens [B, T] int32 (clipped to 0 .. S here); colscale [B, G, N] fp32; q [B, G, P,
    N, C] pieces in the MMA type; rows [B, S, C]; (fp8: scales [B, S, 2]); out: o [B, G, splits, R, N] fp32
    normalised, lse [B, G, splits, N] (natural log, -inf where the split saw nothing)."""
    if fp8:
        sc_ref, o_ref, lse_ref, qc_s, qe_s, c_s, e_s, conv_s, p_s, s_tm, o_tm, q_bar, bar, done = refs
    else:
        o_ref, lse_ref, qc_s, qe_s, c_s, e_s, p_s, s_tm, o_tm, q_bar, bar, done = refs
        conv_s = None
    blocks = kernel.split_stream(
        (lens_ref, q_ref, rows_ref, sc_ref if fp8 else None),
        (qc_s, qe_s, c_s, e_s, q_bar, bar),
        T=T,
        P=P,
        R=R,
        E=E,
        block=BLOCK,
        splits=splits,
        scale_layout=ROW,
    )
    b, g, sp = lax.axis_index("b"), lax.axis_index("g"), lax.axis_index("s")
    tiles = R // CHUNK
    lens_T, lo, n = blocks.lens_T, blocks.lo, blocks.n
    first_row, issue, load_scales = blocks.first_row, blocks.issue, blocks.load_scales

    for j in range(stages):
        pl.when(j < n)(functools.partial(issue, j, j))

    lens_N = kernel.column_lengths(lens_T, T, Hg, N, COL)
    colscale_N = plgpu.load(colscale_ref.at[b, g], layout=COL, optimized=False)
    m0 = plgpu.layout_cast(jnp.full((N,), -jnp.inf, F32), COL)
    l0 = plgpu.layout_cast(jnp.zeros((BLOCK, N), F32), plgpu.Layout.TCGEN05)
    acc0 = tuple(plgpu.layout_cast(jnp.zeros((CHUNK, N), F32), plgpu.Layout.TCGEN05) for _ in range(tiles))
    plgpu.barrier_wait(q_bar)

    # a per-row / per-column vector across the tile; the cast picks TCGEN05 (a column vector's layout is also
    # WGMMA's, which the broadcast would otherwise choose)
    def rows_bcast(v):
        return plgpu.layout_cast(lax.broadcast_in_dim(v, (BLOCK, N), [0]), plgpu.Layout.TCGEN05)

    def cols_bcast(v):
        return plgpu.layout_cast(lax.broadcast_in_dim(v, (BLOCK, N), [1]), plgpu.Layout.TCGEN05)

    s_c_tm = s_tm.at[:, pl.ds(0, N)]
    s_e_tm = s_tm.at[:, pl.ds(N, N)] if fp8 else s_c_tm  # bf16 rows: both parts into one accumulator

    def qk_mmas(q_s, k0, acc_tm, first):
        def mmas(a):
            for j in range(P):
                b_op = q_s.at[j, :, pl.ds(k0, a.shape[1])].T
                plgpu.tcgen05_mma(acc_tm, a, b_op, accumulate=not (first and j == 0))

        return mmas

    def pv_mmas(k):
        def mmas(a):
            for j in range(P):
                plgpu.tcgen05_mma(o_tm.at[:, pl.ds(k * N, N)], a.T, p_s.at[j].T, accumulate=j > 0)

        return mmas

    def step(i, carry):
        acc, m, l, scales = carry
        slot = lax.rem(i, stages)
        plgpu.barrier_wait(bar.at[slot])
        if fp8:
            sc_c, sc_e = scales
            scales = load_scales(i + 1)  # in flight during this block (in bounds: first_row clamps)
        c_blk, e_blk = c_s.at[slot], e_s.at[slot]
        chunks = [
            (c_blk.at[:, pl.ds(k * CHUNK, CHUNK)], qk_mmas(qc_s, k * CHUNK, s_c_tm, k == 0)) for k in range(tiles)
        ]
        chunks.append((e_blk, qk_mmas(qe_s, 0, s_e_tm, fp8)))
        _mma_chunks(chunks, conv_s, done)
        if fp8:
            s = plgpu.async_load_tmem(s_c_tm) * rows_bcast(sc_c) + plgpu.async_load_tmem(s_e_tm) * rows_bcast(sc_e)
        else:
            s = plgpu.async_load_tmem(s_c_tm)
        m_new, alpha, l = kernel.softmax_block(
            s,
            m,
            l,
            p_s,
            i=i,
            lo=lo,
            first_row=first_row,
            lens_N=lens_N,
            colscale_N=colscale_N,
            sc_c=sc_c if fp8 else None,
            layout=plgpu.Layout.TCGEN05,
            rows_bcast=rows_bcast,
            cols_bcast=cols_bcast,
        )
        _mma_chunks([(c_blk.at[:, pl.ds(k * CHUNK, CHUNK)], pv_mmas(k)) for k in range(tiles)], conv_s, done)
        pl.when(i + stages < n)(functools.partial(issue, i + stages, slot))  # the block's last reader is done
        acc = tuple(
            a * cols_bcast(alpha) + plgpu.async_load_tmem(o_tm.at[:, pl.ds(k * N, N)]) for k, a in enumerate(acc)
        )
        plgpu.wait_load_tmem()  # the next block's MMAs overwrite the accumulators
        return acc, m_new, l, scales

    scales0 = load_scales(0) if fp8 else ()
    acc, m, l, _ = lax.fori_loop(0, n, step, (acc0, m0, l0, scales0))

    def store_o(inv_N):
        inv_l = cols_bcast(inv_N)
        for k, a in enumerate(acc):
            o_ref.at[b, g, sp, pl.ds(k * CHUNK, CHUNK)][...] = a * inv_l

    kernel.store_normalised(l, m, lse_ref.at[b, g, sp], fp8=fp8, store_o=store_o)


_STATIC = ("scale", "launch", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def partials(q_lat_BTHR, q_pe_BTHE, rows_BSC, scales_BS2, lens_BT, *, scale, launch: Launch, interpret=None):
    """The kernel alone -> (o [B, G, splits, R, N] fp32 normalised per split, lse [B, G, splits, N] fp32)."""
    mdt, P = kernel.mma_dtype(rows_BSC.dtype), kernel.pieces(q_lat_BTHR.dtype)
    q, colscale = kernel._q_pieces(q_lat_BTHR, q_pe_BTHE, launch.heads_per_group, launch.cols, mdt, P, scale)
    return partials_from_pieces(
        q, colscale, rows_BSC, scales_BS2, lens_BT, R=q_lat_BTHR.shape[-1], launch=launch, interpret=interpret
    )


@functools.partial(jax.jit, static_argnames=("R", "launch", "interpret"))
def partials_from_pieces(q_BGPNC, colscale_BGN, rows_BSC, scales_BS2, lens_BT, *, R, launch: Launch, interpret=None):
    """The kernel on queries already in pieces (kernel._q_pieces) -> partials' (o, lse)."""
    B, G, P, N, C = q_BGPNC.shape
    E = C - R
    T = lens_BT.shape[1]
    fp8 = rows_BSC.dtype == FP8
    mdt, rdt = q_BGPNC.dtype, rows_BSC.dtype
    tr = kernel._transforms
    scratch = [
        plgpu.SMEM((P, N, R), mdt, transforms=tr(mdt, R, C)),
        plgpu.SMEM((P, N, E), mdt, transforms=tr(mdt, E, C)),
        plgpu.SMEM((launch.stages, BLOCK, R), rdt, transforms=tr(rdt, R, C)),
        plgpu.SMEM((launch.stages, BLOCK, E), rdt, transforms=tr(rdt, E, C)),
    ]
    if fp8:  # the ring of converted chunks the MMAs read
        scratch.append(plgpu.SMEM((2, BLOCK, CHUNK), F16, transforms=tr(F16, CHUNK)))
    scratch += [
        plgpu.SMEM((P, N, BLOCK), mdt, transforms=tr(mdt, BLOCK)),
        plgpu.TMEM((BLOCK, (2 if fp8 else 1) * N), F32),  # the scores (fp8: c's, then k_pe's)
        plgpu.TMEM((CHUNK, (R // CHUNK) * N), F32),  # the block's P·V, one [128, N] tile per 128 rows of O^T
        plgpu.Barrier(num_arrivals=2 * P),  # q's TMAs
        plgpu.Barrier(num_arrivals=2, num_barriers=launch.stages),  # a block's c and k_pe
        plgpu.Barrier(num_arrivals=1, num_barriers=2, orders_tensor_core=True),  # MMAs done (per converted tile)
    ]
    body = functools.partial(
        _body, fp8=fp8, P=P, R=R, E=E, N=N, T=T, Hg=launch.heads_per_group, stages=launch.stages, splits=launch.splits
    )
    call = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((B, G, launch.splits, R, N), F32),
            jax.ShapeDtypeStruct((B, G, launch.splits, N), F32),
        ),
        scratch_types=scratch,
        grid=(G, launch.splits, B),  # head groups fastest: a block's rows are read by its groups' CTAs together (L2)
        grid_names=("g", "s", "b"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )
    return call(lens_BT.astype(jnp.int32), colscale_BGN, q_BGPNC, rows_BSC, *([scales_BS2] if fp8 else []))


@functools.partial(jax.jit, static_argnames=_STATIC + ("return_lse",))
def attention(
    q_lat_BTHR, q_pe_BTHE, rows_BSC, scales_BS2, lens_BT, *, scale, launch: Launch, return_lse=False, interpret=None
):
    """o_lat [B, T, H, R] in q's dtype, or with return_lse (o fp32, lse [B, T, H] fp32) (kernel.attention's)."""
    o, lse = partials(
        q_lat_BTHR, q_pe_BTHE, rows_BSC, scales_BS2, lens_BT, scale=scale, launch=launch, interpret=interpret
    )
    T, H = q_lat_BTHR.shape[1:3]
    o, lse = kernel.combine_splits(o, lse, T, H, launch.heads_per_group)
    return (o, lse) if return_lse else o.astype(q_lat_BTHR.dtype)
