"""Blackwell (sm100, GB300's 10.3 included) body of the decode GEMV: kernel.py's streaming GEMV and its pairs' sum
with tcgen05 MMAs, the accumulators in TMEM. Not run on a GPU yet (no Blackwell here): interpret-tested on CPU and
lowered for CUDA under an abstract B200. kernel.py's docstring has the design; what Blackwell changes:

- tcgen05's M is 128 (M = 64 has layout restrictions in Mosaic GPU 0.11.2), so a CTA streams a 128-row block of
  one weight (ROWS), and N at M = 128 is a multiple of 16: the batch is padded to 16s (tokens(B)); x is padded
  as kernel.x_rows says (the tile's TMA fills the rest of its T rows with zeros).
- The MMA is asynchronous and reads its operands from SMEM: step k's MMA arrives on barrier k % 2 when it is
  done, and step k waits for MMA k - 1 before returning, so the pipeline (delay_release = 1) refills stage k - 1
  only once the tensor core has read it, while MMA k runs beside the TMAs in flight (as sm90's WGMMA wait one
  step late). The last MMA is waited after the pipeline, the [128, T] fp32 sum read back by tcgen05.ld.
- Outputs: fp32 partials [S, N_pad, T] (N_pad: N_i in whole 128-row blocks, T = tokens(B); kernel.partials's
  "N" layout with these paddings) stored from registers. With one split a bf16 output is written by the kernel
  itself, every weight (a short last block included) the same way (_store_rows): the sum through SMEM, token b's
  column becoming row b of a [T, 128] tile, one TMA store to out [B, N_i] that drops the rows past B and the
  columns past N_i. The glue after the kernel is kernel.finish, the layouts being kernel.py's.
- gemv_sum: the pairs in lockstep through one pipeline as kernel.py's (kernel.pair_blocks picks each pair's block
  width and swizzle), each pair's accumulator a [128, T] column range of one TMEM allocation (J x T <= 512
  columns), one commit per step for all its MMAs; each product rounded, then the rounded products added in
  order; the [T, 128] tile by TMA as above. N in whole 128-row blocks (7168: 56 CTAs).

Left out against kernel.py: x_stream "M" (the tokens on M, token-major partials), refused by check_supported /
check_sum_supported with a NotImplementedError, so the api runs XLA for a launch that asks for it; tuning.json's
sm100 tables take "N" throughout. Warp specialization (a TMA warp and an MMA warp, as jax's blackwell_matmul_mgpu)
is left out too: one warpgroup issues the TMAs (emit_pipeline) and the MMAs, the simplest form (not measured).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gemv import kernel
from pallas_kernels.gemv.kernel import F32, MAX_TOKENS, pair_blocks, sum_splits, x_rows

__all__ = ["MAX_TOKENS", "check_sum_supported", "check_supported", "gemv", "gemv_sum", "partials", "sum_splits"]

ARCH = "sm100"
TOKENS = 16  # tcgen05's N step at M = 128: the decode batch is padded to a multiple
ROWS = 128  # weight rows per CTA: tcgen05's M
SMEM_BYTES = 227 * 1024  # sm100's per-CTA maximum (as sm90's)
TMEM_COLS = 512  # 32-bit TMEM columns per CTA
X_STREAMS = ("N",)  # the tokens on N only (module docstring)
_TRANSFORMS = kernel._transforms(128)  # a 64-element bf16 row per 128-byte swizzle atom
COL_LAYOUT = plgpu.Layout.TCGEN05.reduce(1)  # a value per row of a [128, T] tile (tcgen05.ld's layout)
_LANE = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def tokens(B):
    """x's tile rows and the MMA's N: the batch padded to 16s."""
    return -(-B // TOKENS) * TOKENS


def _check_x_stream(x_stream):
    if x_stream not in X_STREAMS:
        raise NotImplementedError(f"x_stream={x_stream!r}: the sm100 body takes the tokens on N only {X_STREAMS}")


def smem_bytes(B, D, block_k, split_k, steps):
    """The pipeline's stages (a weight tile and x's tile each) and, with one split, the tiles a written output goes
    out through (_store_rows)."""
    stages = min(steps, D // (split_k * block_k))
    tile = tokens(B) * ROWS * (4 + 2) if split_k == 1 else 0
    return stages * (ROWS + tokens(B)) * block_k * 2 + tile


def _check_steps(steps):
    if steps < 2:
        raise NotImplementedError(f"steps {steps}: two or more (a stage is released one step late)")


def check_supported(x_BD, ws_ND, block_k, split_k, steps=2, x_stream="N"):
    _check_x_stream(x_stream)
    _check_steps(steps)
    kernel.check_operands(x_BD, ws_ND, block_k, split_k)
    B, D = x_BD.shape
    need = smem_bytes(B, D, block_k, split_k, steps)
    if need > SMEM_BYTES:
        raise NotImplementedError(
            f"batch {B}: {steps} stages of weight and x tiles need {need} bytes of SMEM (> {SMEM_BYTES}); lower "
            "steps or block_k"
        )


def _mma_step(k, mmas, done):
    """Step k of a pipeline whose specs release a stage one step late: issue the step's MMAs (mmas()), commit
    them to done[k % 2], and wait for step k - 1's: the pipeline refills that stage once this returns."""
    mmas()
    plgpu.tcgen05_commit_arrive(done.at[lax.rem(k, 2)])

    @pl.when(k > 0)
    def _():
        plgpu.barrier_wait(done.at[lax.rem(k + 1, 2)])


def _store_rows(y_ROWS_T, acc_smem, tile_smem, out_at, n_tokens):
    """The rounded [128, T] sum -> out_at ([T, 128] of the output): through the fp32 [128, T] SMEM tile, token
    b's column (a value per row) becomes row b of the [T, 128] tile, then one TMA store, which drops what lies
    past the output's rows (B) and columns (N). (A tiled, swizzled tile stored transposed from registers would
    skip the first hop, but its TMA needs N a multiple of 64 and B of 8: the MoE's 56 / 224 rows are not.)"""
    acc_smem[...] = y_ROWS_T.astype(F32)  # rounded already: exact in fp32
    plgpu.commit_smem()  # a warpgroup barrier: each token's column is read by other threads than wrote it
    for b in range(n_tokens):
        col = plgpu.load(acc_smem.at[:, b], layout=COL_LAYOUT, optimized=False)
        tile_smem.at[b][...] = col.astype(tile_smem.dtype)
    plgpu.commit_smem()  # the tile's register stores, before the TMA reads it
    plgpu.copy_smem_to_gmem(tile_smem, out_at)
    plgpu.wait_smem_to_gmem(0)


def _body(x_ref, *refs, n_blocks, block_k, steps, k_slabs, T, n_tokens):
    """x_ref: x [x_rows(B), D], read in [T, block_k] tiles whose rows past x's the TMA fills with zeros. refs: the
    weights [N_i, D], then the outputs: fp32 partials [S, N_pad, T] (N_pad: N_i in whole blocks) or, with one
    split, a bf16 output itself [1, B, N_i]; then scratch: the TMEM accumulator [128, T], the MMAs' two
    barriers and (any bf16 output) the fp32 [128, T] and bf16 [T, 128] tiles it is stored through."""
    n_w = len(n_blocks)
    ws, outs = refs[:n_w], refs[n_w : 2 * n_w]
    acc_tmem, done, *staging = refs[2 * n_w :]
    blk, s = lax.axis_index("n"), lax.axis_index("k")
    k_range = pl.ds(s * k_slabs * block_k, k_slabs * block_k)  # this CTA's columns of D

    def run(w_ref, out_ref, row_blk):
        def step(idx, w_smem, x_smem):  # acc [128, T] (+)= w [128, block_k] @ xᵀ [block_k, T]
            k = idx[0]
            mma = lambda: plgpu.tcgen05_mma(acc_tmem, w_smem, x_smem.transpose((1, 0)), accumulate=k > 0)  # noqa: E731
            _mma_step(k, mma, done)

        # a stage: the weight's [128, block_k] tile and x's [T, block_k] tile of the same K block; a short last
        # block's rows past N arrive as the TMA's zeros
        specs = [
            plgpu.BlockSpec((ROWS, block_k), lambda k: (row_blk, k), transforms=_TRANSFORMS, delay_release=1),
            plgpu.BlockSpec((T, block_k), lambda k: (0, k), transforms=_TRANSFORMS, delay_release=1),
        ]
        plgpu.emit_pipeline(step, grid=(k_slabs,), max_concurrent_steps=steps, in_specs=specs)(
            w_ref.at[:, k_range], x_ref.at[:, k_range]
        )
        plgpu.barrier_wait(done.at[(k_slabs - 1) % 2])  # the last MMA
        acc = plgpu.async_load_tmem(acc_tmem)
        plgpu.wait_load_tmem()
        block = pl.ds(row_blk * ROWS, ROWS)
        if out_ref.dtype == F32:  # the partial, padded to whole blocks
            out_ref.at[s, block][...] = acc
        else:  # one split: the output itself, exactly [B, N]
            _store_rows(acc.astype(out_ref.dtype), *staging, out_ref.at[0, pl.ds(0, T), block], n_tokens)

    first = 0
    for w_ref, out_ref, n in zip(ws, outs, n_blocks, strict=True):  # which weight this block is in
        pl.when((blk >= first) & (blk < first + n))(functools.partial(run, w_ref, out_ref, blk - first))
        first += n


_STATIC = ("block_k", "split_k", "steps", "x_stream", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC + ("out_dtypes",))
def gemv(x_BD, ws_ND, *, block_k=128, split_k=2, steps=6, x_stream="N", out_dtypes=None, interpret=None):
    """kernel.gemv's contract: x [B, D] bf16 times each out-major weight [N_i, D] bf16 -> tuple of [B, N_i] in
    out_dtypes (default bf16; fp32: the sum unrounded; fp32 sums either way); with one split the kernel writes a
    bf16 output itself."""
    _check_x_stream(x_stream)
    out_dtypes = out_dtypes or (x_BD.dtype,) * len(ws_ND)
    written = tuple(F32 if split_k > 1 else d for d in out_dtypes)
    parts = _partials(
        x_BD, ws_ND, block_k=block_k, split_k=split_k, steps=steps, interpret=interpret, out_dtypes=written
    )
    return kernel.finish(parts, ws_ND, written, out_dtypes, x_BD.shape[0])


@functools.partial(jax.jit, static_argnames=_STATIC)
def partials(x_BD, ws_ND, *, block_k=128, split_k=2, steps=6, x_stream="N", interpret=None):
    """The kernel alone: tuple of fp32 [split_k, N_pad, T] (T = tokens(B), N_pad = N_i in whole 128-row blocks),
    sum over axis 0 and column b = token b's output (columns B..T-1 and rows N_i..N_pad-1 are padding, the rows
    zeros): kernel.partials's "N" layout."""
    _check_x_stream(x_stream)
    return _partials(x_BD, ws_ND, block_k=block_k, split_k=split_k, steps=steps, interpret=interpret)


def _partials(x_BD, ws_ND, *, block_k, split_k, steps, interpret, out_dtypes=None):
    """out_dtypes: what each weight's CTAs write, fp32 partials (the default) or, with one split, the output
    in x's dtype."""
    B, D = x_BD.shape
    T = tokens(B)
    out_dtypes = out_dtypes or (F32,) * len(ws_ND)
    n_blocks = tuple(-(-w.shape[0] // ROWS) for w in ws_ND)
    # x padded only where Mosaic's TMA needs it (kernel.x_rows): an XLA pad is a kernel launch of its own
    x_TD = jnp.pad(x_BD, ((0, x_rows(B) - B), (0, 0)))
    k_slabs = D // block_k // split_k
    scratch = [
        plgpu.TMEM((ROWS, T), F32),
        plgpu.Barrier(num_arrivals=1, num_barriers=2, orders_tensor_core=True),  # MMA k done: done[k % 2]
    ]
    if any(d != F32 for d in out_dtypes):  # _store_rows's tiles
        scratch += [plgpu.SMEM((ROWS, T), F32), plgpu.SMEM((T, ROWS), x_BD.dtype)]

    def out_shape(N, n, d):
        return (1, B, N) if d != F32 else (split_k, n * ROWS, T)

    call = plgpu.kernel(
        functools.partial(
            _body, n_blocks=n_blocks, block_k=block_k, steps=min(steps, k_slabs), k_slabs=k_slabs, T=T, n_tokens=B
        ),
        out_type=tuple(
            jax.ShapeDtypeStruct(out_shape(w.shape[0], n, d), d)
            for w, n, d in zip(ws_ND, n_blocks, out_dtypes, strict=True)
        ),
        scratch_types=scratch,
        grid=(sum(n_blocks), split_k),
        grid_names=("n", "k"),
        compiler_params=_LANE,
        interpret=interpret,
    )
    return tuple(call(x_TD, *ws_ND))


# ---- several (x_j, w_j) pairs sharing N, summed into one output (the MoE's finish): kernel.py's section -------
def sum_smem_bytes(B, Ks, block_k, steps):
    """The pipeline's stages (every pair's weight and x tiles) and _store_rows's tiles."""
    n, bks, _ = pair_blocks(Ks, block_k)
    T = tokens(B)
    return min(steps, n) * (ROWS + T) * sum(bks) * 2 + T * ROWS * (4 + 2)


def check_sum_supported(xs_BK, ws_NK, block_k, split_k=1, steps=2, x_stream="N"):
    _check_x_stream(x_stream)
    _check_steps(steps)
    kernel.check_sum_operands(xs_BK, ws_NK, block_k, split_k, ROWS)
    B, J = xs_BK[0].shape[0], len(xs_BK)
    if J * tokens(B) > TMEM_COLS:
        raise NotImplementedError(f"{J} pairs x {tokens(B)} tokens: an accumulator each, > {TMEM_COLS} TMEM columns")
    need = sum_smem_bytes(B, [x.shape[1] for x in xs_BK], block_k, steps)
    if need > SMEM_BYTES:
        raise NotImplementedError(
            f"batch {B}: {steps} stages of every pair's tiles need {need} bytes of SMEM (> {SMEM_BYTES}); lower "
            "steps or block_k"
        )


def _sum_body(*refs, bks, swizzles, n_steps, steps, T, n_tokens):
    """refs: the x_j [x_rows(B), K_j], the w_j [N, K_j], the output [B, N], then scratch: the accumulators
    [128, J x T] in TMEM (pair j's the columns j T .. j T + T - 1), the MMAs' two barriers, _store_rows's fp32
    [128, T] and bf16 [T, 128] tiles."""
    J = len(bks)
    xs, ws, (out_ref, acc_tmem, done, acc_smem, tile_smem) = refs[:J], refs[J : 2 * J], refs[2 * J :]
    blk = lax.axis_index("n")
    accs = [acc_tmem.at[:, pl.ds(j * T, T)] for j in range(J)]

    def step(idx, *tiles):  # each pair's weight tile, then its x tile
        k = idx[0]

        def mmas():  # acc_j [128, T] (+)= w_j [128, bk_j] @ x_jᵀ [bk_j, T]
            for acc, w_smem, x_smem in zip(accs, tiles[::2], tiles[1::2], strict=True):
                plgpu.tcgen05_mma(acc, w_smem, x_smem.transpose((1, 0)), accumulate=k > 0)

        _mma_step(k, mmas, done)

    specs = []
    for bk, sw in zip(bks, swizzles, strict=True):  # block k of pair j: columns past K_j are the TMA's zeros
        tr = kernel._transforms(sw)
        specs.append(plgpu.BlockSpec((ROWS, bk), lambda k: (blk, k), transforms=tr, delay_release=1))
        specs.append(plgpu.BlockSpec((T, bk), lambda k: (0, k), transforms=tr, delay_release=1))
    gmem = [r for pair in zip(ws, xs, strict=True) for r in pair]
    plgpu.emit_pipeline(step, grid=(n_steps,), max_concurrent_steps=steps, in_specs=specs)(*gmem)
    plgpu.barrier_wait(done.at[(n_steps - 1) % 2])  # the last step's MMAs
    sums = [plgpu.async_load_tmem(acc) for acc in accs]
    plgpu.wait_load_tmem()
    dtype = out_ref.dtype
    y = sums[0].astype(dtype)  # each product rounded (a bf16 GEMM), then the bf16 adds in order
    for acc in sums[1:]:
        y = (y.astype(F32) + acc.astype(dtype).astype(F32)).astype(dtype)
    _store_rows(y, acc_smem, tile_smem, out_ref.at[pl.ds(0, T), pl.ds(blk * ROWS, ROWS)], n_tokens)


@functools.partial(jax.jit, static_argnames=_STATIC)
def gemv_sum(xs_BK, ws_NK, *, block_k=192, split_k=1, steps=2, x_stream="N", interpret=None):
    """kernel.gemv_sum's contract: Σ_j x_j [B, K_j] @ w_jᵀ (w_j out-major [N, K_j], bf16) -> [B, N] in x's dtype in
    one launch, each product rounded, the rounded products added in order (reference.gemv_sum)."""
    del split_k  # one split: the table's field, checked by check_sum_supported
    _check_x_stream(x_stream)
    B, N = xs_BK[0].shape[0], ws_NK[0].shape[0]
    T = tokens(B)
    n, bks, swizzles = pair_blocks([x.shape[1] for x in xs_BK], block_k)
    xs_TK = tuple(jnp.pad(x, ((0, x_rows(B) - B), (0, 0))) for x in xs_BK)
    dtype = xs_BK[0].dtype
    call = plgpu.kernel(
        functools.partial(_sum_body, bks=bks, swizzles=swizzles, n_steps=n, steps=min(steps, n), T=T, n_tokens=B),
        out_type=jax.ShapeDtypeStruct((B, N), dtype),
        scratch_types=[
            plgpu.TMEM((ROWS, len(xs_BK) * T), F32),
            plgpu.Barrier(num_arrivals=1, num_barriers=2, orders_tensor_core=True),
            plgpu.SMEM((ROWS, T), F32),
            plgpu.SMEM((T, ROWS), dtype),
        ],
        grid=(N // ROWS,),
        grid_names=("n",),
        compiler_params=_LANE,
        interpret=interpret,
    )
    return call(*xs_TK, *ws_NK)
