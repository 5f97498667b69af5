"""Streaming GEMV on Hopper tensor cores: y = x @ wᵀ for a decode batch (B <= 64) and out-major weights.

At decode batch the projection is a pure weight stream (45 MB for one TP16 rank's q/k/v/g + f_a), so the kernel
only has to keep HBM busy and accumulate in fp32. Each CTA streams one 64-row block of one weight over a 1/S
slice of D through a multi-stage TMA pipeline, x's tile of the same K block beside the weight's in each stage
(from L2: every CTA of a K range reads it); S (split_k) spreads the row blocks over the 132 SMs. Several weights
sharing x (q/k/v/g and f_a) run in one launch: the grid covers all their row blocks. The CTA writes its fp32
partial and the wrapper sums the S partials and rounds once (one small XLA fusion), or a consumer reads them
itself (the KDA decode kernel); with one split the kernel rounds and writes the output itself. An output asked
for in fp32 (the MoE router's logits) is the sum unrounded. The result equals reference.gemv up to the order of
the fp32 sums.

Where the tokens go (x_stream; tuning.json says which batches take which):
- "N": the weight rows on WGMMA's M and the tokens on N (docs/pallas_mgpu.md §3: the decode GEMV orientation), a
  [round8(B), block_k] x tile, partials [S, N, T] (token b in column b). With one split the accumulator goes
  through SMEM and each token's row is stored from it.
- "M": the tokens on M, a [64, block_k] x tile (the TMA fills the rows past B with zeros), partials token-major
  [S, 64, N], so a token's outputs are contiguous for the KDA decode kernel (column b of [S, N, 64] would be
  4-byte reads 256 bytes apart). Below 64 tokens the mostly-zero x tile doubles each stage's SMEM fill, which
  is why the small batches take N.
x streams beside the weights rather than staying resident in SMEM: resident slabs grow with the batch, and the
resident form measured slower at every batch (bench/results/gemv_b64_stream.json, gemv_small_on_n.json).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F32 = jnp.float32
TOKENS = 8  # WGMMA's smallest N (and its step): the decode batch is padded to a multiple
MAX_TOKENS = 64  # the decode batches served: past them a GEMM, not a GEMV
ROWS = 64  # weight rows per CTA: one WGMMA M tile
SMEM_BYTES = 227 * 1024  # sm90's per-CTA maximum
_SWIZZLE = 128  # bytes: a 64-element bf16 row per swizzle atom
_TRANSFORMS = (plgpu.TilingTransform((8, _SWIZZLE // 2)), plgpu.SwizzleTransform(_SWIZZLE))


X_STREAMS = ("M", "N")  # where the tokens go: WGMMA's M (64-row x tiles) or N (the batch padded to 8s)


def tokens(B, x_stream="N"):
    """x's tile rows: the batch padded to WGMMA's N granularity, or (tokens on M) its M of 64."""
    return MAX_TOKENS if x_stream == "M" else -(-B // TOKENS) * TOKENS


def x_rows(B):
    """The rows of x the kernel reads: x as it is where Mosaic's TMA takes it (fewer than 8 rows, or whole 8s),
    else padded to whole 8s (it refuses 12 rows); the tile's TMA fills any rows past them with zeros."""
    return B if B < TOKENS or B % TOKENS == 0 else tokens(B)


def smem_bytes(B, D, block_k, split_k, steps, x_stream="N"):
    """The pipeline's stages, each a weight tile and x's tile (on N with one split, plus the fp32 accumulator
    the output is written from)."""
    stages = min(steps, D // (split_k * block_k))
    acc = ROWS * tokens(B) * 4 if x_stream == "N" and split_k == 1 else 0
    return stages * (ROWS + tokens(B, x_stream)) * block_k * 2 + acc


def check_supported(x_BD, ws_ND, block_k, split_k, steps=2, x_stream="N"):
    B, D = x_BD.shape
    if x_stream not in X_STREAMS:
        raise NotImplementedError(f"x_stream={x_stream!r}: one of {X_STREAMS}")
    if x_BD.dtype != jnp.bfloat16 or any(w.dtype != jnp.bfloat16 for w in ws_ND):
        raise NotImplementedError(f"bf16 only: x {x_BD.dtype}, w {[str(w.dtype) for w in ws_ND]}")
    if B > MAX_TOKENS:
        raise NotImplementedError(f"batch {B} > {MAX_TOKENS}: a GEMM, not a decode GEMV (XLA's is fine there)")
    if any(w.ndim != 2 or w.shape[1] != D or w.shape[0] % ROWS for w in ws_ND):
        raise NotImplementedError(f"weights {[w.shape for w in ws_ND]}: need [N, {D}] with N % {ROWS} == 0")
    if D % (split_k * block_k) or D // (split_k * block_k) < 2:
        raise NotImplementedError(
            f"D = {D} is not split_k {split_k} x block_k {block_k} x 2 or more (the "
            "pipeline releases a stage one step late, so it needs two)"
        )
    if smem_bytes(B, D, block_k, split_k, steps, x_stream) > SMEM_BYTES:
        raise NotImplementedError(
            f"batch {B}: {steps} stages of weight and x tiles need "
            f"{smem_bytes(B, D, block_k, split_k, steps, x_stream)} bytes "
            f"of SMEM (> {SMEM_BYTES}); lower steps or block_k"
        )


def _body(x_ref, *refs, n_blocks, block_k, steps, k_slabs, T, x_stream, n_tokens):
    """x_ref: x [x_rows(B), D], read in [T, block_k] tiles whose rows past x's the TMA fills with zeros. refs:
    the weights [N_i, D], then the partials [S, N_i, T] fp32 ("M": [S, T, N_i]; with one split a bf16 output
    itself, "M" [1, T, N_i], "N" [1, B, N_i]), then (on N with one split) scratch: the fp32
    accumulator [ROWS, T] that the n_tokens output rows are read from."""
    n_w = len(n_blocks)
    ws, outs, scratch = refs[:n_w], refs[n_w : 2 * n_w], refs[2 * n_w :]
    blk, s = lax.axis_index("n"), lax.axis_index("k")
    k_range = pl.ds(s * k_slabs * block_k, k_slabs * block_k)  # this CTA's columns of D

    def run(w_ref, out_ref, row_blk):
        def scope(acc_ref):
            def step(_, w_smem, x_smem):
                if x_stream == "M":  # acc [T, ROWS] += x [T, block_k] @ wᵀ [block_k, ROWS]
                    plgpu.wgmma(acc_ref, x_smem, w_smem.transpose((1, 0)))
                else:  # acc [ROWS, T] += w [ROWS, block_k] @ xᵀ [block_k, T]
                    plgpu.wgmma(acc_ref, w_smem, x_smem.transpose((1, 0)))

            # a stage: the weight's [ROWS, block_k] tile and x's [T, block_k] tile of the same K block
            specs = [
                plgpu.BlockSpec((ROWS, block_k), lambda k: (row_blk, k), transforms=_TRANSFORMS, delay_release=1),
                plgpu.BlockSpec((T, block_k), lambda k: (0, k), transforms=_TRANSFORMS, delay_release=1),
            ]
            plgpu.emit_pipeline(step, grid=(k_slabs,), max_concurrent_steps=steps, in_specs=specs)(
                w_ref.at[:, k_range], x_ref.at[:, k_range]
            )
            return acc_ref[...]

        block = pl.ds(row_blk * ROWS, ROWS)
        if x_stream == "M":  # token-major [S, T, N]; with one split the output itself (out_ref in x's dtype)
            out_ref.at[s, :, block][...] = pl.run_scoped(scope, plgpu.ACC((T, ROWS), F32)).astype(out_ref.dtype)
        elif out_ref.dtype != F32:  # "N", one split: the output, token-major, through SMEM
            acc_smem = scratch[-1]
            acc_smem[...] = pl.run_scoped(scope, plgpu.ACC((ROWS, T), F32))
            plgpu.commit_smem()  # a warpgroup barrier: each token's column is read by other threads
            for b in range(n_tokens):  # column b in the row layout (4 lanes a row) -> out row b, rounded once
                col = plgpu.load(acc_smem.at[:, b], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                out_ref.at[0, b, block][...] = col.astype(out_ref.dtype)
        else:  # WGMMA layout straight to GMEM: 2 KB at T = 8
            out_ref.at[s, block][...] = pl.run_scoped(scope, plgpu.ACC((ROWS, T), F32))

    first = 0
    for w_ref, out_ref, n in zip(ws, outs, n_blocks, strict=True):  # which weight this CTA's block is in
        pl.when((blk >= first) & (blk < first + n))(functools.partial(run, w_ref, out_ref, blk - first))
        first += n


_STATIC = ("block_k", "split_k", "steps", "x_stream", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC + ("out_dtypes",))
def gemv(x_BD, ws_ND, *, block_k=128, split_k=2, steps=6, x_stream="N", out_dtypes=None, interpret=None):
    """x [B, D] bf16 times each out-major weight [N_i, D] bf16 -> tuple of [B, N_i] in out_dtypes (default bf16;
    fp32: the sum unrounded; fp32 sums either way). With one split the kernel rounds and writes a bf16 output
    itself: no glue kernel; an fp32 output's one partial is the sum."""
    B = x_BD.shape[0]
    out_dtypes = out_dtypes or (x_BD.dtype,) * len(ws_ND)
    # what the kernel writes: fp32 partials, or with one split a bf16 output itself
    written = tuple(F32 if split_k > 1 else d for d in out_dtypes)
    parts = _partials(
        x_BD,
        ws_ND,
        block_k=block_k,
        split_k=split_k,
        steps=steps,
        x_stream=x_stream,
        interpret=interpret,
        out_dtypes=written,
    )
    outs = []
    for p, w_dtype, dtype in zip(parts, written, out_dtypes, strict=True):
        if w_dtype != F32:  # [1, 64 ("M") or B ("N"), N_i] in x's dtype
            outs.append(p[0, :B])
        elif x_stream == "M":  # token-major
            outs.append(p.sum(0)[:B].astype(dtype))
        else:
            outs.append(p.sum(0)[:, :B].T.astype(dtype))
    return tuple(outs)


@functools.partial(jax.jit, static_argnames=_STATIC)
def partials(x_BD, ws_ND, *, block_k=128, split_k=2, steps=6, x_stream="N", interpret=None):
    """The kernel alone: tuple of fp32 [split_k, N_i, T] (T = tokens(B)), sum over axis 0 and column b = token
    b's output (columns B..T-1 are padding); with x_stream "M" token-major [split_k, 64, N_i], row b token b's. A
    consumer that reads these itself (the KDA decode kernel) saves the glue."""
    return _partials(x_BD, ws_ND, block_k=block_k, split_k=split_k, steps=steps, x_stream=x_stream, interpret=interpret)


def _partials(x_BD, ws_ND, *, block_k, split_k, steps, x_stream, interpret, out_dtypes=None):
    """out_dtypes: what each weight's CTAs write, fp32 partials (the default) or, with one split, the output
    in x's dtype."""
    B, D = x_BD.shape
    T = tokens(B, x_stream)
    out_dtypes = out_dtypes or (F32,) * len(ws_ND)
    n_blocks = tuple(w.shape[0] // ROWS for w in ws_ND)
    # x padded only where Mosaic's TMA needs it (x_rows): an XLA pad is a kernel launch of its own
    x_TD = jnp.pad(x_BD, ((0, x_rows(B) - B), (0, 0)))
    k_slabs = D // block_k // split_k
    direct_n = tuple(x_stream == "N" and d != F32 for d in out_dtypes)
    scratch = [plgpu.SMEM((ROWS, T), F32)] if any(direct_n) else []  # the accumulator, whose columns become rows

    def out_shape(N, direct):
        if direct:
            return (1, B, N)
        return (split_k, T, N) if x_stream == "M" else (split_k, N, T)

    kernel = plgpu.kernel(
        functools.partial(
            _body,
            n_blocks=n_blocks,
            block_k=block_k,
            steps=min(steps, k_slabs),
            k_slabs=k_slabs,
            T=T,
            x_stream=x_stream,
            n_tokens=B,
        ),
        out_type=tuple(
            jax.ShapeDtypeStruct(out_shape(w.shape[0], direct), d)
            for w, d, direct in zip(ws_ND, out_dtypes, direct_n, strict=True)
        ),
        scratch_types=scratch,
        grid=(sum(n_blocks), split_k),
        grid_names=("n", "k"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )
    return tuple(kernel(x_TD, *ws_ND))
