"""MLA decode attention over the latent cache as one Mosaic GPU kernel (Hopper WGMMA), plus a small XLA combine.

The form (one warpgroup per CTA; the grid is head groups x context splits x sequences):
- Positions on WGMMA's M, the (token, head) columns on N. The local heads are few (6 at TP16, 12 at TP8) and
  all share one cached row, so the scores of a 64-position block are S^T [64, N] = rows [64, C] · q^T, N the
  T x heads of a head group padded to 8, and the latent output is O^T [R, N] += c^T [R, 64] · P^T [64, N]. Heads
  on M (FlashMLA's form, for 64-128 heads per GPU) would pad 6-12 heads to 64 rows: 5-10x the MMA work, which
  at batch 64 x 8K positions is ~92 us of bf16 tensor time against a 64 us HBM floor.
- Flash decoding: each (sequence, head group) runs `splits` CTAs, CTA s taking the s-th share of that sequence's
  own valid blocks (ceil(len / 64) blocks, split evenly), so only valid positions are read whatever the cache
  capacity and lengths differ freely across the batch. Each CTA writes its normalised O^T and log-sum-exp; an
  XLA fusion combines the splits, transposes to [B, T, H, R] and rounds once.
- The block loop is a TMA pipeline of `stages` slots (c [64, R] and k_pe [64, E] of the block, fp8 or bf16).
  The last block of a sequence overlaps the one before instead of reading past the cache (its repeated rows
  are masked), so every load is in bounds and any capacity S >= 64 works.
- FP8 e4m3 rows run fp16 MMAs: e4m3 -> f16 is one exact cvt per two elements (the ptxas in use has no
  e4m3 -> bf16 cvt: through f32 it is 2-3 instructions an element), into one f16 SMEM tile that both MMAs read.
  The per-row scales never touch an element: the c and k_pe scores come from two accumulators, each scaled per
  row in fp32, and c's scale is folded into P before its rounding (P'_s = p_s sc_s 2^9: the factor puts P'
  near |c|'s own range, far from f16's subnormals; divided out with the row sums). f16 has 3 more mantissa
  bits than bf16 but a range of 65504: the wrapper scales each query column by a power of two (exact) so
  its largest element is in [2^14, 2^15), and the scores undo it in fp32. The scales come straight from GMEM
  (4-byte loads, the next block's in flight during this one): a TMA box of [64, 2] fp32 is 8 bytes wide, which
  TMA refuses, and interpret mode cannot reshape an SMEM ref. (A bf16 form, e4m3 -> f32 -> bf16 with bf16 P,
  was the first: with P' = bf16(p sc) a one-position sequence rounds its whole row twice, 1.6x the reference's
  error against float64; f16's P' is 8x finer.)
- Online softmax in fp32 (exp2, the scale and log2 e folded into one multiply), a column's max across the
  block's rows (a cross-warp reduction), the running row sums kept per element and reduced once at the end.
- fp32 compute: q and P are sums of 3 pieces in the MMA type (bf16 or f16: 24 bits or more; the rows are
  exact in it), each piece its own MMA into the same fp32 accumulator, so the products are exact and the
  result is fp32-accurate (no TF32 anywhere). q's pieces are cut in the XLA wrapper through reduce_precision
  (common.round_to): XLA GPU folds a convert pair f32 -> bf16 -> f32 into its input, which
  made q's later pieces 0 (float32 only bf16/f16-accurate on the H200, issue 27). P's are cut in the kernel,
  which Mosaic compiles (arith.truncf / extf without fast-math flags: MLIR and LLVM keep the pair). Interpret
  mode runs the body as XLA code, which a CPU compile emulating that folding would fold too, so the CPU test of
  it hands the kernel q pieces made that way (partials_from_pieces) and compiles the kernel as usual.

acc: how P·V meets the running output. "state": the running accumulator goes into the MMA (pl.run_state,
as jax's attention_mgpu.py). "add": a fresh accumulator per block, added in registers (twice the registers
for O^T); interpret mode in jax 0.11.2 runs neither pl.run_state nor a store into an accumulator, so
interpret always runs "add" (the "state" form is lowered on CPU and run on the GPU).
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import round_to

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
FP8 = jnp.float8_e4m3fn
BLOCK = 64  # positions per block: WGMMA's M
COL_STEP = 8  # WGMMA's N granularity: the (token, head) columns are padded to a multiple
SMEM_BYTES = 227 * 1024  # sm90's per-CTA maximum
ACC_MODES = ("state", "add")
LOG2E = math.log2(math.e)
P_SCALE = 512.0  # fp8: P' = p sc 2^9, so P' is about |c| (fp16's normal range), not |c| / 448
Q_TOP = 14  # fp16 queries: each column scaled by a power of two into [2^14, 2^15)
LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class Launch:
    """How a call is laid out (pick_launch)."""

    heads_per_group: int  # Hg: a CTA's heads (its columns are T x Hg)
    cols: int  # N = T x Hg padded to COL_STEP
    splits: int  # CTAs per (sequence, head group) along the context
    stages: int  # TMA slots in flight
    acc: str  # "state" | "add"
    qk_regs: bool = False  # fp8: the scores' MMA takes each converted chunk from registers (see _body)


def _transforms(dtype, minor, gmem_minor=None):
    """Tiling + swizzle for SMEM rows of `minor` elements: the widest swizzle (<= 128 B) that divides the row,
    and (for a TMA source) the GMEM row the tiles are cut from."""
    size = jnp.dtype(dtype).itemsize
    rows = (minor * size, (gmem_minor or minor) * size)
    swizzle = next((s for s in (128, 64, 32) if all(r % s == 0 for r in rows)), None)
    if swizzle is None:
        raise NotImplementedError(f"a row of {minor} {jnp.dtype(dtype).name} is not a multiple of 32 bytes")
    return (plgpu.TilingTransform((8, swizzle // size)), plgpu.SwizzleTransform(swizzle))


def load_fp8_tile(ref):
    """An fp8 tile of SMEM ([64 k, 64]) in registers for its conversion, 8 consecutive elements a thread: one 8-byte
    ld.shared, and their f16 values one 16-byte st.shared, where the default layout (WGMMA's, for an MMA operand)
    holds 2 a thread. The sm100 body's conversion; on Hopper it measured slower than the default layout
    (bench/results/mla_variants_s31_h100.json: 64 x 8K 144.1 vs 135.5 us) and was removed there."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA_UPCAST_4X, optimized=True)


def mma_dtype(row_dtype):
    """The MMA operand type: fp16 for fp8 rows (their exact, cheap conversion), bf16 for bf16 rows."""
    return F16 if jnp.dtype(row_dtype) == FP8 else BF16


def pieces(compute_dtype) -> int:
    """MMA-type pieces per operand: 1 for bf16 compute, 3 for fp32."""
    return 3 if jnp.dtype(compute_dtype) == F32 else 1


def smem_bytes(R, E, cols, stages, row_dtype, compute_dtype) -> int:
    """The kernel's SMEM as Pallas lays it out: each scratch buffer rounded up to 1 KiB, the 2 KiB cross-warp
    reduction scratch, 1 KiB for the barriers."""
    P, rb, fp8 = pieces(compute_dtype), jnp.dtype(row_dtype).itemsize, jnp.dtype(row_dtype).itemsize == 1
    buffers = [P * cols * R, P * cols * E]  # q pieces (2-byte MMA type)
    buffers = [2 * n for n in buffers] + [stages * BLOCK * R * rb, stages * BLOCK * E * rb]
    buffers += [2 * BLOCK * R, 2 * BLOCK * E] if fp8 else []  # the converted block
    buffers += [2 * P * cols * BLOCK]  # P^T pieces
    return sum(-(-n // 1024) * 1024 for n in buffers) + 2048 + 1024


def check_inputs(q_lat_BTHR, q_pe_BTHE, rows_BSC, scales_BS2):
    """The dtypes every body takes: bf16 or float32 compute, fp8 e4m3 rows with fp32 scales [B, S, 2] or bf16 rows."""
    B, S = rows_BSC.shape[:2]
    if q_lat_BTHR.dtype not in (BF16, F32) or q_pe_BTHE.dtype != q_lat_BTHR.dtype:
        raise NotImplementedError(f"compute dtype {q_lat_BTHR.dtype}/{q_pe_BTHE.dtype}: bf16 or float32")
    if rows_BSC.dtype == FP8:
        if scales_BS2 is None or scales_BS2.shape != (B, S, 2) or scales_BS2.dtype != F32:
            raise NotImplementedError("fp8 rows need their fp32 scales [B, S, 2]")
    elif rows_BSC.dtype != BF16:
        raise NotImplementedError(f"rows in {rows_BSC.dtype}: the kernel reads fp8 e4m3 or bf16 rows")


def check_supported(q_lat_BTHR, q_pe_BTHE, rows_BSC, scales_BS2, launch: Launch):
    check_inputs(q_lat_BTHR, q_pe_BTHE, rows_BSC, scales_BS2)
    R, E, S = q_lat_BTHR.shape[-1], q_pe_BTHE.shape[-1], rows_BSC.shape[1]
    if R % 64 or E % 64:
        raise NotImplementedError(f"R = {R}, E = {E}: multiples of 64 (one 128-byte bf16 swizzle row)")
    if S < BLOCK:
        raise NotImplementedError(f"a cache of {S} positions: the kernel reads whole blocks of {BLOCK}")
    if launch.acc not in ACC_MODES:
        raise NotImplementedError(f"acc={launch.acc!r}: one of {ACC_MODES}")
    if launch.cols > 256:
        raise NotImplementedError(f"{launch.cols} columns: WGMMA's N is at most 256")
    need = smem_bytes(R, E, launch.cols, launch.stages, rows_BSC.dtype, q_lat_BTHR.dtype)
    if need > SMEM_BYTES:
        raise NotImplementedError(f"{launch.stages} stages need {need} bytes of SMEM (> {SMEM_BYTES})")


@dataclasses.dataclass(frozen=True)
class SplitStream:
    """A CTA's share of its sequence's valid blocks and how it fetches them (both bodies: kernel.py, kernel_sm100.py).
    lens_T: the rows each token sees (scalars clipped to 0 .. S); lo / n: the split's first block and its count;
    first_row(i): block i's first row (the last block overlaps its predecessor rather than leave the cache);
    issue(i, slot): block i's c and k_pe TMAs into the slot; load_scales(i): its rows' (c, k_pe) scales."""

    lens_T: list
    lo: jax.Array
    n: jax.Array
    first_row: Callable
    issue: Callable
    load_scales: Callable


def split_stream(gmem, smem, *, T, P, R, E, block, splits, scale_layout) -> SplitStream:
    """The split's blocks of sequence b (grid axes "b", "g", "s"); its query pieces' TMAs issued on q_bar. gmem:
    (lens, q, rows, scales or None) refs; smem: (q's c and k_pe pieces, the block slots' c and k_pe, q_bar, the
    slots' barriers)."""
    lens_ref, q_ref, rows_ref, sc_ref = gmem
    qc_s, qe_s, c_s, e_s, q_bar, bar = smem
    b, g, sp = lax.axis_index("b"), lax.axis_index("g"), lax.axis_index("s")
    S = rows_ref.shape[1]
    lens_T = [jnp.clip(lens_ref[b, t], 0, S) for t in range(T)]  # scalars (no XLA kernel before this one)
    nblk = (functools.reduce(jnp.maximum, lens_T) + block - 1) // block  # this sequence's valid blocks
    per = (nblk + splits - 1) // splits
    lo = sp * per  # this split's first block
    n = jnp.clip(nblk - lo, 0, per)
    for j in range(P):  # a TMA per piece (a [P, N, C] box would need 6 strided dims; TMA takes 5)
        plgpu.copy_gmem_to_smem(q_ref.at[b, g, j, :, pl.ds(0, R)], qc_s.at[j], q_bar)
        plgpu.copy_gmem_to_smem(q_ref.at[b, g, j, :, pl.ds(R, E)], qe_s.at[j], q_bar)

    def first_row(i):
        return jnp.minimum((lo + i) * block, S - block)

    def issue(i, slot):
        at = rows_ref.at[b, pl.ds(first_row(i), block)]
        plgpu.copy_gmem_to_smem(at.at[:, pl.ds(0, R)], c_s.at[slot], bar.at[slot])
        plgpu.copy_gmem_to_smem(at.at[:, pl.ds(R, E)], e_s.at[slot], bar.at[slot])

    def load_scales(i):  # one per accumulator row
        at = sc_ref.at[b, pl.ds(first_row(i), block)]
        return tuple(plgpu.load(at.at[:, k], layout=scale_layout, optimized=False) for k in (0, 1))

    return SplitStream(lens_T, lo, n, first_row, issue, load_scales)


def column_lengths(lens_T, T, Hg, N, layout):
    """Each (token, head) column's visible rows [N] (column t Hg + h is token t's; the padding columns, token T
    and past, see nothing): both bodies, in their column layout."""
    token_N = plgpu.broadcasted_iota(jnp.int32, (N,), 0, layout=layout) // Hg
    lens_N = jnp.zeros((N,), jnp.int32)
    for t in range(T):
        lens_N = jnp.where(token_N == t, lens_T[t], lens_N)
    return lens_N


def softmax_block(s, m, l, p_s, *, i, lo, first_row, lens_N, colscale_N, sc_c, layout, rows_bcast, cols_bcast):
    """Block i of the split's online softmax, both bodies: s [block, N] fp32 scores (fp8: already times the rows'
    scales), m [N] the running max (base 2), l [block, N] the running sums kept per element -> (m_new, alpha
    [N], l). Rows before the split's own blocks (from block lo on; first_row: SplitStream's) or at a column's
    length and past are masked; P (times c's scale sc_c x P_SCALE per row where sc_c is given: fp8) is stored
    into p_s as the MMA type's pieces, transposed (K-major for P·V), and committed for the async proxy."""
    block = s.shape[0]
    s = s * cols_bcast(colscale_N)  # base-2 logits
    row = first_row(i) + plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=layout)
    visible = (row >= (lo + i) * block) & (row < cols_bcast(lens_N))
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=0))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a column with nothing visible yet: p = 0, alpha = 0
    alpha = jnp.exp2(m - m_use)
    p = jnp.exp2(s - cols_bcast(m_use))
    l = l * cols_bcast(alpha) + p
    if sc_c is not None:
        p = p * rows_bcast(sc_c * P_SCALE)  # c's scale, folded into P before its rounding
    P = p_s.shape[0]
    for j in range(P):  # P^T as pieces in the MMA type, stored [N, block]; Mosaic keeps the astype pair below
        # (no XLA here on the GPU: see the module docstring)
        piece = p.astype(p_s.dtype)
        p_s.at[j].T[...] = piece
        if j + 1 < P:
            p = p - piece.astype(F32)
    plgpu.commit_smem()
    return m_new, alpha, l


def store_normalised(l, m, lse_ref, *, fp8, store_o):
    """The split's end, both bodies: store_o(1 / l per column, 0 where nothing was seen) writes o; lse [N] (natural
    log, -inf where nothing was seen) to lse_ref."""
    l_N = l.sum(axis=0)
    seen = l_N > 0
    if fp8:
        l_N = l_N * P_SCALE  # o's share; the lse below adds log2 P_SCALE back
    store_o(jnp.where(seen, 1.0 / jnp.where(seen, l_N, 1.0), 0.0))
    log2_l = jnp.log2(jnp.where(seen, l_N, 1.0)) - (math.log2(P_SCALE) if fp8 else 0.0)
    lse_ref[...] = jnp.where(seen, (m + log2_l) * LN2, -jnp.inf)


def _body(lens_ref, colscale_ref, q_ref, rows_ref, *refs, fp8, P, R, E, N, T, Hg, stages, splits, acc_mode, qk_regs):
    """lens [B, T] int32: the rows token t sees (clipped to 0 .. S here); colscale [B, G, N] fp32: a column's
    scores factor (softmax scale x log2 e / its query's power-of-two scaling); q [B, G, P, N, C] pieces in the
    MMA type; rows [B, S, C]; (fp8: scales [B, S, 2]); out: o [B, G, splits, R, N] fp32 normalised, lse
    [B, G, splits, N] (natural log, -inf where the split saw nothing)."""
    if fp8:
        sc_ref, o_ref, lse_ref, qc_s, qe_s, c_s, e_s, cb_s, eb_s, p_s, q_bar, bar = refs
    else:
        o_ref, lse_ref, qc_s, qe_s, c_s, e_s, p_s, q_bar, bar = refs
    blocks = split_stream(
        (lens_ref, q_ref, rows_ref, sc_ref if fp8 else None),
        (qc_s, qe_s, c_s, e_s, q_bar, bar),
        T=T,
        P=P,
        R=R,
        E=E,
        block=BLOCK,
        splits=splits,
        scale_layout=plgpu.Layout.WGMMA.reduce(1),
    )
    b, g, sp = lax.axis_index("b"), lax.axis_index("g"), lax.axis_index("s")
    lens_T, lo, n = blocks.lens_T, blocks.lo, blocks.n
    first_row, issue, load_scales = blocks.first_row, blocks.issue, blocks.load_scales

    for j in range(stages):
        pl.when(j < n)(functools.partial(issue, j, j))

    col = plgpu.Layout.WGMMA.reduce(0)
    lens_N = column_lengths(lens_T, T, Hg, N, col)
    colscale_N = plgpu.load(colscale_ref.at[b, g], layout=col, optimized=False)
    m0 = plgpu.layout_cast(jnp.full((N,), -jnp.inf, F32), col)
    l0 = plgpu.layout_cast(jnp.zeros((BLOCK, N), F32), plgpu.Layout.WGMMA)
    acc0 = plgpu.layout_cast(jnp.zeros((R, N), F32), plgpu.Layout.WGMMA)
    plgpu.barrier_wait(q_bar)

    def rows_bcast(v):  # a per-row vector across the columns
        return lax.broadcast_in_dim(v, (BLOCK, N), [0])

    def cols_bcast(v, rows=BLOCK):  # a per-column vector down the rows
        return lax.broadcast_in_dim(v, (rows, N), [1])

    def step(i, carry):
        acc, m, l, scales = carry
        slot = lax.rem(i, stages)
        with jax.named_scope("wait"):  # the phases of a block, each a span in an in-kernel profile (profile_dir)
            plgpu.barrier_wait(bar.at[slot])
        if fp8:
            c_src, e_src = cb_s, eb_s
            sc_c, sc_e = scales
            scales = load_scales(i + 1)  # in flight during this block (in bounds: first_row clamps)
        else:
            c_src, e_src = c_s.at[slot], e_s.at[slot]

        def convert():  # e4m3 -> f16 (exact), 64 columns at a time (registers stay few)
            for k0 in range(0, R, 64):
                cols = pl.ds(k0, 64)
                cb_s.at[:, cols][...] = c_s.at[slot, :, cols][...].astype(F16)
            eb_s[...] = e_s.at[slot][...].astype(F16)

        def qk(acc_c, acc_e):
            for j in range(P):
                plgpu.wgmma(acc_c, c_src, qc_s.at[j].T)
                plgpu.wgmma(acc_e, e_src, qe_s.at[j].T)
            return acc_c[...], acc_e[...]

        def convert_and_qk(acc_c, acc_e):  # qk_regs: each converted chunk is also the MMA's A, from registers,
            for k0 in range(0, R, 64):  # so its MMA runs while the next chunk converts
                cols = pl.ds(k0, 64)
                x = c_s.at[slot, :, cols][...].astype(F16)
                cb_s.at[:, cols][...] = x
                for j in range(P):
                    plgpu.wgmma(acc_c, x, qc_s.at[j, :, cols].T)
            x = e_s.at[slot][...].astype(F16)
            eb_s[...] = x
            for j in range(P):
                plgpu.wgmma(acc_e, x, qe_s.at[j].T)
            return acc_c[...], acc_e[...]

        accs = (plgpu.ACC((BLOCK, N), F32), plgpu.ACC((BLOCK, N), F32))
        if fp8 and qk_regs:
            with jax.named_scope("convert_qk"):
                s_c, s_e = pl.run_scoped(convert_and_qk, *accs)
                plgpu.commit_smem()  # P·V reads the converted tile
            pl.when(i + stages < n)(functools.partial(issue, i + stages, slot))  # the slot is free once converted
        else:
            if fp8:
                with jax.named_scope("convert"):
                    convert()
                    plgpu.commit_smem()
                pl.when(i + stages < n)(functools.partial(issue, i + stages, slot))
            with jax.named_scope("qk"):
                s_c, s_e = pl.run_scoped(qk, *accs)
        with jax.named_scope("softmax"):
            s = s_c * rows_bcast(sc_c) + s_e * rows_bcast(sc_e) if fp8 else s_c + s_e
            m_new, alpha, l = softmax_block(
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
                layout=plgpu.Layout.WGMMA,
                rows_bcast=rows_bcast,
                cols_bcast=cols_bcast,
            )
            acc = acc * cols_bcast(alpha, R)

        def pv(acc_ref):
            for j in range(P):
                plgpu.wgmma(acc_ref, c_src.T, p_s.at[j].T)

        with jax.named_scope("pv"):
            if acc_mode == "state":
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            else:
                acc = acc + pl.run_scoped(lambda r: (pv(r), r[...])[1], plgpu.ACC((R, N), F32))
        if not fp8:
            pl.when(i + stages < n)(functools.partial(issue, i + stages, slot))  # after P·V read the slot
        return acc, m_new, l, scales

    scales0 = load_scales(0) if fp8 else ()
    acc, m, l, _ = lax.fori_loop(0, n, step, (acc0, m0, l0, scales0))

    def store_o(inv_N):
        o_ref.at[b, g, sp][...] = acc * cols_bcast(inv_N, R)

    store_normalised(l, m, lse_ref.at[b, g, sp], fp8=fp8, store_o=store_o)


def split_count(tuning: dict, groups: int, S: int, block: int) -> int:
    """Context splits of each of `groups` (sequence, head group) pairs, both bodies: the most whose groups x
    splits CTAs fit tuning's `ctas` (one wave: a CTA fills an SM, so a partial second wave would run its blocks
    while most SMs idle: 64 x 8K at 3 splits was 192 CTAs, 1.45 waves), but no split shorter than
    min_split_blocks blocks of the capacity S (the combine reads splits x R x N x 4 bytes per sequence and head
    group), and at most max_splits."""
    by_capacity = max(1, -(-S // block) // tuning["min_split_blocks"])
    return max(1, min(tuning["ctas"] // groups, by_capacity, tuning["max_splits"]))


def pick_launch(tuning: dict, B, T, H, R, E, S, row_dtype, compute_dtype) -> Launch:
    """tuning.json's sm90 entry -> the launch for this call. Head groups: the most heads whose T x Hg columns
    fit max_cols (registers: O^T is R x N fp32 over 128 threads) and whose SMEM holds two of the entry's
    stages (fp32's q pieces are 3x bf16's), fewer stages only where one head is too much. Splits: split_count."""
    want = tuning["stages"]["fp8" if jnp.dtype(row_dtype) == FP8 else "bf16"]

    def stages_for(cols):
        fits = [s for s in range(want, 0, -1) if smem_bytes(R, E, cols, s, row_dtype, compute_dtype) <= SMEM_BYTES]
        return fits[0] if fits else 1

    def cols_for(hg):
        return -(-T * hg // COL_STEP) * COL_STEP

    groups = [d for d in range(H, 0, -1) if H % d == 0 and T * d <= max(tuning["max_cols"], T)]
    Hg = next((d for d in groups if stages_for(cols_for(d)) >= min(2, want)), groups[-1])
    return Launch(
        heads_per_group=Hg,
        cols=cols_for(Hg),
        splits=split_count(tuning, B * (H // Hg), S, BLOCK),
        stages=stages_for(cols_for(Hg)),
        acc=tuning["acc"],
        qk_regs=bool(tuning.get("qk_regs", False)),
    )


def _q_pieces(q_lat_BTHR, q_pe_BTHE, Hg, N, mdt, P, scale):
    """[B, T, H, R] + [B, T, H, E] -> (q [B, G, P, N, C] in the MMA type, colscale [B, G, N] fp32): a head
    group's (token, head) columns (column t Hg + h), padded to N with zeros, as P pieces whose sum is q (exact
    for fp32 at P = 3); for fp16 each column first times a power of two that puts its largest element in
    [2^14, 2^15) (exact), which colscale (the scores' factor: scale x log2 e) divides out again."""
    B, T, H, R = q_lat_BTHR.shape
    C = R + q_pe_BTHE.shape[-1]
    G = H // Hg
    q = jnp.concatenate([q_lat_BTHR, q_pe_BTHE], axis=-1).reshape(B, T, G, Hg, C)
    q = jnp.swapaxes(q, 1, 2).reshape(B, G, T * Hg, C)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, N - T * Hg), (0, 0))).astype(F32)
    colscale = jnp.full((B, G, N), scale * LOG2E, F32)
    if mdt == F16:
        top = jnp.max(jnp.abs(q), axis=-1)
        _, e = jnp.frexp(jnp.where(top > 0, top, 1.0))  # top in [2^(e-1), 2^e)
        shift = Q_TOP + 1 - e  # ldexp: exact powers of two
        q = jnp.ldexp(q, shift[..., None])
        colscale = jnp.ldexp(colscale, -shift)
    out = []
    for j in range(P):
        # round_to, not astype: XLA GPU drops the convert pair f32 -> mdt -> f32, which made every residual
        # q - piece 0 (float32 was bf16-accurate on the H200); the last piece needs no residual after it
        piece = round_to(q, mdt) if j + 1 < P else q.astype(mdt)
        out.append(piece)
        q = q - piece.astype(F32)
    return jnp.stack(out, axis=2), colscale


_STATIC = ("scale", "launch", "interpret")  # scale: the softmax's, (qk_nope + qk_rope)^-1/2


@functools.partial(jax.jit, static_argnames=_STATIC + ("profile_dir",))
def partials(
    q_lat_BTHR, q_pe_BTHE, rows_BSC, scales_BS2, lens_BT, *, scale, launch: Launch, interpret=None, profile_dir=""
):
    """The kernel alone -> (o [B, G, splits, R, N] fp32 normalised per split, lse [B, G, splits, N] fp32).
    lens_BT: the rows token t sees (clipped to 0 .. S in the kernel). profile_dir: see partials_from_pieces."""
    mdt, P = mma_dtype(rows_BSC.dtype), pieces(q_lat_BTHR.dtype)
    q, colscale = _q_pieces(q_lat_BTHR, q_pe_BTHE, launch.heads_per_group, launch.cols, mdt, P, scale)
    return partials_from_pieces(
        q,
        colscale,
        rows_BSC,
        scales_BS2,
        lens_BT,
        R=q_lat_BTHR.shape[-1],
        launch=launch,
        interpret=interpret,
        profile_dir=profile_dir,
    )


@functools.partial(jax.jit, static_argnames=("R", "launch", "interpret", "profile_dir"))
def partials_from_pieces(
    q_BGPNC, colscale_BGN, rows_BSC, scales_BS2, lens_BT, *, R, launch: Launch, interpret=None, profile_dir=""
):
    """The kernel on queries already in pieces (_q_pieces: q [B, G, P, N, C] in the MMA type, colscale [B, G, N]),
    R of C = R + E the latent part -> partials' (o, lse). Tests hand it pieces made as XLA GPU compiles them.
    profile_dir: write Mosaic GPU's in-kernel trace of each block's phases there (wait, convert, qk, softmax, pv;
    GPU only, with a CPU device beside it: bench/mla_layer.py --profile)."""
    B, G, P, N, C = q_BGPNC.shape
    E = C - R
    T = lens_BT.shape[1]
    fp8 = rows_BSC.dtype == FP8
    Hg, splits, stages = launch.heads_per_group, launch.splits, launch.stages
    acc_mode = "add" if interpret is not None else launch.acc
    mdt = q_BGPNC.dtype
    rdt = rows_BSC.dtype
    scratch = [
        plgpu.SMEM((P, N, R), mdt, transforms=_transforms(mdt, R, C)),
        plgpu.SMEM((P, N, E), mdt, transforms=_transforms(mdt, E, C)),
        plgpu.SMEM((stages, BLOCK, R), rdt, transforms=_transforms(rdt, R, C)),
        plgpu.SMEM((stages, BLOCK, E), rdt, transforms=_transforms(rdt, E, C)),
    ]
    if fp8:  # the block converted to f16, which both MMAs read
        scratch += [
            plgpu.SMEM((BLOCK, R), F16, transforms=_transforms(F16, R)),
            plgpu.SMEM((BLOCK, E), F16, transforms=_transforms(F16, E)),
        ]
    scratch += [
        plgpu.SMEM((P, N, BLOCK), mdt, transforms=_transforms(mdt, BLOCK)),
        plgpu.Barrier(num_arrivals=2 * P),  # q's TMAs
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # a block's c and k_pe
    ]
    body = functools.partial(
        _body,
        fp8=fp8,
        P=P,
        R=R,
        E=E,
        N=N,
        T=T,
        Hg=Hg,
        stages=stages,
        splits=splits,
        acc_mode=acc_mode,
        qk_regs=launch.qk_regs and interpret is None,  # interpret mode takes no MMA operand in registers
    )
    kernel = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((B, G, splits, R, N), F32),
            jax.ShapeDtypeStruct((B, G, splits, N), F32),
        ),
        scratch_types=scratch,
        grid=(G, splits, B),  # head groups fastest: a block's rows are read by its groups' CTAs together (L2)
        grid_names=("g", "s", "b"),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Lane,
            profile_space=1024 if profile_dir else 0,  # in SMEM (4 KB): ~50 blocks' phases, then truncated
            profile_dir=profile_dir,
            profile_bounds_check=bool(profile_dir),
        ),
        interpret=interpret,
    )
    return kernel(lens_BT.astype(jnp.int32), colscale_BGN, q_BGPNC, rows_BSC, *([scales_BS2] if fp8 else []))


def combine_splits(o_BGsRN, lse_BGsN, T, H, Hg):
    """The splits' partials -> (o [B, T, H, R] fp32, lse [B, T, H] fp32): o = Σ_s exp(lse_s - lse) o_s."""
    B, G, _, R, N = o_BGsRN.shape
    o_BGsRN, lse_BGsN = o_BGsRN[..., : T * Hg], lse_BGsN[..., : T * Hg]
    top = jnp.max(lse_BGsN, axis=2, keepdims=True)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    w = jnp.exp(lse_BGsN - top)  # 0 for an empty split
    total = jnp.sum(w, axis=2)
    o = jnp.sum(o_BGsRN * w[:, :, :, None, :], axis=2) / jnp.where(total > 0, total, 1.0)[:, :, None, :]
    lse = jnp.log(total) + top[:, :, 0]
    o = o.reshape(B, G, R, T, Hg).transpose(0, 3, 1, 4, 2).reshape(B, T, H, R)
    lse = lse.reshape(B, G, T, Hg).transpose(0, 2, 1, 3).reshape(B, T, H)
    return o, lse


@functools.partial(jax.jit, static_argnames=_STATIC + ("return_lse",))
def attention(
    q_lat_BTHR, q_pe_BTHE, rows_BSC, scales_BS2, lens_BT, *, scale, launch: Launch, return_lse=False, interpret=None
):
    """o_lat [B, T, H, R] in q's dtype, or with return_lse (o fp32, lse [B, T, H] fp32). lens_BT: the rows token t
    sees, 0 .. S."""
    o, lse = partials(
        q_lat_BTHR, q_pe_BTHE, rows_BSC, scales_BS2, lens_BT, scale=scale, launch=launch, interpret=interpret
    )
    T, H = q_lat_BTHR.shape[1:3]
    o, lse = combine_splits(o, lse, T, H, launch.heads_per_group)
    return (o, lse) if return_lse else o.astype(q_lat_BTHR.dtype)
