"""Streaming GEMV on Hopper tensor cores: y = x @ wᵀ for a decode batch (B <= 64) and out-major weights.

At decode batch the projection is a pure weight stream (45 MB for one TP16 rank's q/k/v/g + f_a at B = 1),
so the kernel only has to keep HBM busy and accumulate in fp32. The weight's rows go on WGMMA's M (64 or
128 per block) and the tokens, padded to a multiple of 8, on N (PALLAS_MGPU.md: the decode GEMV
orientation), so no weight is transposed and x is read once per CTA. Each CTA streams one row block of one
weight over a 1/S slice of D through a multi-stage TMA pipeline; S (split_k) spreads a few hundred row blocks
over the 132 SMs. The CTA writes its fp32 partial [rows, tokens] and the wrapper sums the S partials,
transposes and rounds once (one small XLA fusion), so the result equals reference.gemv up to the order of
the fp32 sums. x comes from L2 once per CTA: at 64 tokens that is as many bytes as the CTA's 64 weight rows,
which 128-row blocks halve (the batch-64 experiment, bench/NOTES.md KDA "Eleventh session").

Several weights sharing x (q/k/v/g and f_a) run in one launch: the grid covers all their row blocks.

x resident (x_stream False) was the first form; the tuning now streams x at every batch (tuning.json).
x_stream="M": x is not held resident but streamed beside the weights, one [64, block_k]
tile per pipeline stage (from L2: every CTA of a K range reads it; the TMA fills the tile's rows past B with
zeros), and the tokens go on WGMMA's M and the weight rows on N, so the partials come out token-major
[S, 64, N]: a token's outputs are contiguous for the KDA decode kernel that reads them (column b of
[S, N, 64] was 4-byte reads 256 bytes apart: the decode kernel took 28.8 instead of 19.1 us at TP16 B = 64,
kda_layer_b64_stream_nt.json). Resident x slabs
grow with the batch (D / split_k x 64 tokens x 2 bytes), so at batch 64 only long splits fit (7: 350 CTAs of
195 KB, about 2.7 waves of one CTA per SM, each wave paying its pipeline's fill); streamed, split 2 fits and
TP16's 50 row blocks x 2 run as one wave with short partials: 13.4 vs 18.9 us (H200, gemv_b64_stream_nt.json).
Below 64 tokens the 64-row tile reads past B, which measured 2.7-3 us slower (16.1 us at B = 16 against 13.2
at 64, gemv_mid_batch.json). x_stream="N" streams x the same way with the tokens on N as the resident path
has them (a [round8(B), block_k] tile, no rows past B at whole 8s) and the resident path's partials [S, N, T]:
12.1-12.8 us at B = 1-48 (gemv_tokens_on_n.json, gemv_small_on_n.json), the tuned launch up to batch 32.
With one split either orientation writes the rounded output itself, on N a row per token from the
accumulator in SMEM (o_proj up to batch 8), so no glue kernel follows.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F32 = jnp.float32
TOKENS = 8  # WGMMA's smallest N (and its step): the decode batch is padded to a multiple
MAX_TOKENS = 64  # the decode batches served (x's slabs grow with it: see check_supported)
ROWS = 64  # WGMMA's M: weight rows per CTA by default; rows=128 reads each x slab for two M tiles
SMEM_BYTES = 227 * 1024  # sm90's per-CTA maximum
_SWIZZLE = 128  # bytes: a 64-element bf16 row per swizzle atom
_TRANSFORMS = (plgpu.TilingTransform((8, _SWIZZLE // 2)), plgpu.SwizzleTransform(_SWIZZLE))


X_STREAMS = (False, "M", "N")  # x resident; or streamed with the tokens on WGMMA's M (64-row tiles) or N


def tokens(B, x_stream=False):
    """The batch padded to WGMMA's N granularity, or (x_stream "M": tokens on M) to its M of 64."""
    return MAX_TOKENS if x_stream == "M" else -(-B // TOKENS) * TOKENS


def x_rows(B, x_stream=False):
    """The rows of x the kernel reads: a resident x padded to tokens(B); a streamed x as it is where Mosaic's
    TMA takes it (fewer than 8 rows, or whole 8s), else padded to whole 8s (it refuses 12 rows)."""
    if not x_stream:
        return tokens(B)
    return B if B < TOKENS or B % TOKENS == 0 else tokens(B)


def smem_bytes(B, D, block_k, split_k, steps, rows=ROWS, x_stream=False):
    """x's slabs for this CTA's K range (resident for the whole stream) + the weight pipeline's stages; with
    x_stream each stage holds x's tile beside the weight's and nothing is resident (on N with one split, plus
    the fp32 accumulator the output is written from)."""
    stages = min(steps, D // (split_k * block_k))
    if x_stream:
        acc = rows * tokens(B) * 4 if x_stream == "N" and split_k == 1 else 0
        return stages * (rows + tokens(B, x_stream)) * block_k * 2 + acc
    return (D // split_k * tokens(B) + stages * rows * block_k) * 2


def check_supported(x_BD, ws_ND, block_k, split_k, steps=2, rows=ROWS, x_stream=False):
    B, D = x_BD.shape
    if x_stream not in X_STREAMS:
        raise NotImplementedError(f"x_stream={x_stream!r}: one of {X_STREAMS}")
    if x_BD.dtype != jnp.bfloat16 or any(w.dtype != jnp.bfloat16 for w in ws_ND):
        raise NotImplementedError(f"bf16 only: x {x_BD.dtype}, w {[str(w.dtype) for w in ws_ND]}")
    if B > MAX_TOKENS:
        raise NotImplementedError(f"batch {B} > {MAX_TOKENS}: a GEMM, not a decode GEMV (XLA's is fine there)")
    if rows not in (64, 128):
        raise NotImplementedError(f"rows={rows}: one or two WGMMA M tiles (64 or 128) per CTA")
    if any(w.ndim != 2 or w.shape[1] != D or w.shape[0] % rows for w in ws_ND):
        raise NotImplementedError(f"weights {[w.shape for w in ws_ND]}: need [N, {D}] with N % {rows} == 0")
    if D % (split_k * block_k) or D // (split_k * block_k) < 2:
        raise NotImplementedError(f"D = {D} is not split_k {split_k} x block_k {block_k} x 2 or more (the "
                                  "pipeline releases a stage one step late, so it needs two)")
    if smem_bytes(B, D, block_k, split_k, steps, rows, x_stream) > SMEM_BYTES:
        raise NotImplementedError(f"batch {B}: x ({'streamed' if x_stream else 'resident'}) and {steps} weight "
                                  f"stages need {smem_bytes(B, D, block_k, split_k, steps, rows, x_stream)} bytes "
                                  f"of SMEM (> {SMEM_BYTES}); raise split_k, stream x or lower steps / block_k")


def _body(x_ref, *refs, n_blocks, block_k, steps, rows, k_slabs, T, x_stream, n_tokens):
    """x_ref: x padded to T tokens, [T, D] (x_stream: x as it is, [B, D], read in [T, block_k] tiles whose rows
    past B the TMA fills with zeros). refs: the weights [N_i, D], then the partials [S, N_i, T] fp32 (x_stream
    "M": [S, T, N_i]; with one split, "M" and "N" write the output itself, [1, T or B, N_i] in x's dtype), then
    scratch: (resident x) this CTA's x slabs [K blocks, T, block_k] (a slab a leading index, not a slice of a
    swizzled dim), each one TMA of x's [T, block_k] columns, and their barriers; ("N", one split) the fp32
    accumulator [rows, T] that the n_tokens output rows are read from."""
    n_w = len(n_blocks)
    ws, outs, scratch = refs[:n_w], refs[n_w:2 * n_w], refs[2 * n_w:]
    blk, s = lax.axis_index("n"), lax.axis_index("k")
    k_range = pl.ds(s * k_slabs * block_k, k_slabs * block_k)  # this CTA's columns of D
    if not x_stream:
        x_smem, x_bar = scratch
        for j in range(k_slabs):  # x: one TMA per slab, all in flight with the weight pipeline's first stages
            plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds((s * k_slabs + j) * block_k, block_k)], x_smem.at[j],
                                    x_bar.at[j])

    def run(w_ref, out_ref, row_blk):
        def scope(acc_ref):
            # Resident x: each step waits for its own slab, so the weight pipeline's first loads go out with x's:
            # waiting for every slab first serialised x (131 KB per CTA from L2 at T = 64) before the weight
            # stream (H200, batch 64: 20.3 us for TP16's 47 MB, gemv_b64.json).
            def step(idx, w_smem, *x_tile):
                if x_stream == "M":  # acc [T, rows] += x [T, block_k] @ wᵀ [block_k, rows]
                    plgpu.wgmma(acc_ref, x_tile[0], w_smem.transpose((1, 0)))
                elif x_stream == "N":  # acc [rows, T] += w [rows, block_k] @ xᵀ [block_k, T]
                    plgpu.wgmma(acc_ref, w_smem, x_tile[0].transpose((1, 0)))
                else:  # the same with x's resident slab
                    plgpu.barrier_wait(x_bar.at[idx[0]])
                    plgpu.wgmma(acc_ref, w_smem, x_smem.at[idx[0]].transpose((1, 0)))

            specs = [plgpu.BlockSpec((rows, block_k), lambda k: (row_blk, k), transforms=_TRANSFORMS,
                                     delay_release=1)]
            srcs = [w_ref.at[:, k_range]]
            if x_stream:  # x's [T, block_k] tile of the same K block, in the same stage
                specs.append(plgpu.BlockSpec((T, block_k), lambda k: (0, k), transforms=_TRANSFORMS, delay_release=1))
                srcs.append(x_ref.at[:, k_range])
            plgpu.emit_pipeline(step, grid=(k_slabs,), max_concurrent_steps=steps, in_specs=specs)(*srcs)
            return acc_ref[...]

        block = pl.ds(row_blk * rows, rows)
        if x_stream == "M":  # token-major [S, T, N]; with one split the output itself (out_ref in x's dtype)
            out_ref.at[s, :, block][...] = pl.run_scoped(scope, plgpu.ACC((T, rows), F32)).astype(out_ref.dtype)
        elif x_stream == "N" and out_ref.dtype != F32:  # one split: the output, token-major, through SMEM
            acc_smem = scratch[-1]
            acc_smem[...] = pl.run_scoped(scope, plgpu.ACC((rows, T), F32))
            plgpu.commit_smem()  # a warpgroup barrier: each token's column is read by other threads
            for b in range(n_tokens):  # column b in the row layout (4 lanes a row) -> out row b, rounded once
                col = plgpu.load(acc_smem.at[:, b], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                out_ref.at[0, b, block][...] = col.astype(out_ref.dtype)
        else:  # WGMMA layout straight to GMEM: 2 KB at T = 8
            out_ref.at[s, block][...] = pl.run_scoped(scope, plgpu.ACC((rows, T), F32))

    first = 0
    for w_ref, out_ref, n in zip(ws, outs, n_blocks, strict=True):  # which weight this CTA's block is in
        pl.when((blk >= first) & (blk < first + n))(functools.partial(run, w_ref, out_ref, blk - first))
        first += n


_STATIC = ("block_k", "split_k", "steps", "rows", "x_stream", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def gemv(x_BD, ws_ND, *, block_k=256, split_k=2, steps=4, rows=ROWS, x_stream=False, interpret=None):
    """x [B, D] bf16 times each out-major weight [N_i, D] bf16 -> tuple of [B, N_i] bf16 (fp32 sums). With x
    streamed and one split the kernel rounds and writes the output itself: no glue kernel."""
    B = x_BD.shape[0]
    direct = x_stream in ("M", "N") and split_k == 1
    parts = _partials(x_BD, ws_ND, block_k=block_k, split_k=split_k, steps=steps, rows=rows, x_stream=x_stream,
                      interpret=interpret, out_dtype=x_BD.dtype if direct else F32)
    if direct:  # [1, 64 ("M") or B ("N"), N_i] in x's dtype
        return tuple(p[0, :B] for p in parts)
    if x_stream == "M":  # token-major
        return tuple(p.sum(0)[:B].astype(x_BD.dtype) for p in parts)
    return tuple(p.sum(0)[:, :B].T.astype(x_BD.dtype) for p in parts)


@functools.partial(jax.jit, static_argnames=_STATIC)
def partials(x_BD, ws_ND, *, block_k=256, split_k=2, steps=4, rows=ROWS, x_stream=False, interpret=None):
    """The kernel alone: tuple of fp32 [split_k, N_i, T] (T = tokens(B)), sum over axis 0 and column b = token
    b's output (columns B..T-1 are padding); with x_stream "M" token-major [split_k, 64, N_i], row b token b's. A
    consumer that reads these itself (the KDA decode kernel) saves the glue."""
    return _partials(x_BD, ws_ND, block_k=block_k, split_k=split_k, steps=steps, rows=rows, x_stream=x_stream,
                     interpret=interpret)


def _partials(x_BD, ws_ND, *, block_k, split_k, steps, rows, x_stream, interpret, out_dtype=F32):
    B, D = x_BD.shape
    T = tokens(B, x_stream)
    n_blocks = tuple(w.shape[0] // rows for w in ws_ND)
    # Resident x: padded to T (whole 8s; a no-op at B = 8). Streamed: padded only where Mosaic's TMA needs it
    # (x_rows; XLA's pad kernel was 1.2-1.4 us at B = 16 on the H200); the TMA of a [T, block_k] tile fills
    # the rows past x's with zeros.
    x_TD = jnp.pad(x_BD, ((0, x_rows(B, x_stream) - B), (0, 0)))
    k_slabs = D // block_k // split_k
    scratch = []
    if not x_stream:  # resident: one slab per K block of this CTA's range, [k_slabs, T, block_k]
        scratch = [plgpu.SMEM((k_slabs, T, block_k), x_BD.dtype, transforms=_TRANSFORMS),
                   plgpu.Barrier(num_barriers=k_slabs)]
    direct_n = x_stream == "N" and out_dtype != F32
    if direct_n:  # the accumulator, whose columns become the output's rows
        scratch = [plgpu.SMEM((rows, T), F32)]
    kernel = plgpu.kernel(
        functools.partial(_body, n_blocks=n_blocks, block_k=block_k, steps=min(steps, k_slabs), rows=rows,
                          k_slabs=k_slabs, T=T, x_stream=x_stream, n_tokens=B),
        out_type=tuple(jax.ShapeDtypeStruct((1, B, w.shape[0]) if direct_n else (split_k, T, w.shape[0])
                                            if x_stream == "M" else (split_k, w.shape[0], T), out_dtype)
                       for w in ws_ND),
        scratch_types=scratch,
        grid=(sum(n_blocks), split_k), grid_names=("n", "k"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )
    return tuple(kernel(x_TD, *ws_ND))
