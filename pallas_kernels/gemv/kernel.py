"""Streaming GEMV on Hopper tensor cores: y = x @ wᵀ for a decode batch (B <= 64) and out-major weights.

At decode batch the projection is a pure weight stream (45 MB for one TP16 rank's q/k/v/g + f_a), so the kernel
only has to keep HBM busy and accumulate in fp32. Each CTA streams one 64-row block of one weight over a 1/S
slice of D through a multi-stage TMA pipeline, x's tile of the same K block beside the weight's in each stage
(from L2: every CTA of a K range reads it); S (split_k) spreads the row blocks over the 132 SMs. Several weights
sharing x (q/k/v/g and f_a; the MoE's router, latent_down and shared gate/up) run in one launch: the grid covers
all their row blocks. The CTA writes its fp32 partial and the wrapper sums the S partials and rounds once
(at batch 1 chained adds that XLA fuses into the output's consumer), or a consumer reads them itself (the KDA decode
kernel); with one split the kernel rounds and writes the output itself. An output asked for in fp32 (the MoE
router's logits) is the sum unrounded. The result equals reference.gemv up to the order of the fp32 sums.

Where the tokens go (x_stream; tuning.json says which batches take which):
- "N": the weight rows on WGMMA's M and the tokens on N (docs/pallas_mgpu.md §3: the decode GEMV orientation), a
  [round8(B), block_k] x tile, partials [S, N, T] (token b in column b). With one split the accumulator goes
  through SMEM and each token's row is stored from it.
- "M": the tokens on M, a [64, block_k] x tile (the TMA fills the rows past B with zeros), partials token-major
  [S, 64, N], so a token's outputs are contiguous for the KDA decode kernel (column b of [S, N, 64] would be
  4-byte reads 256 bytes apart). Below 64 tokens the mostly-zero x tile doubles each stage's SMEM fill, which
  is why the small batches take N.

A weight's rows need not be whole 64-row blocks (a multiple of 8: one TP16 rank's MoE router has 56 rows, its
latent_down 224): the last block's weight TMA reads past the array, which fills those rows with zeros as it fills x's
tile past B. Nothing is written past N. The fp32 partials (register stores) are padded to whole blocks, and the XLA sum
that reads them slices them (the slice joins a fusion that runs anyway). A bf16 output the kernel writes itself
(one split) goes out as a rounded [T, 64] SMEM tile through a TMA store, which drops the rows past B and the
columns past N: the output is exactly [B, N], with no XLA slice (a copy kernel of its own where the consumer
cannot fuse it, e.g. a Pallas kernel). Weights of whole blocks keep the register stores that were measured.

gemv_sum is the pairs' form: several (x_j [B, K_j], w_j [N, K_j]) sharing N summed into one [B, N] output in
one launch (the MoE's finish, latent_up + shared_down), each product rounded before the sum as the model rounds
it; its section below says how.

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


X_WINDOWS = True  # gemv_sum reads x windows (x_starts) in place: its x tiles start at the window's column
X_STREAMS = ("M", "N")  # where the tokens go: WGMMA's M (64-row x tiles) or N (the batch padded to 8s)


def tokens(B, x_stream="N"):
    """x's tile rows: the batch padded to WGMMA's N granularity, or (tokens on M) its M of 64."""
    return MAX_TOKENS if x_stream == "M" else -(-B // TOKENS) * TOKENS


def x_rows(B):
    """The rows of x the kernel reads: x as it is where Mosaic's TMA takes it (fewer than 8 rows, or whole 8s),
    else padded to whole 8s (it refuses 12 rows); the tile's TMA fills any rows past them with zeros."""
    return B if B < TOKENS or B % TOKENS == 0 else tokens(B)


def ragged(N):
    """A weight whose last row block is short: its rows past N are the TMA's zeros, its stores kept inside N."""
    return N % ROWS != 0


def smem_bytes(B, D, block_k, split_k, steps, x_stream="N", any_ragged=False):
    """The pipeline's stages, each a weight tile and x's tile (on N with one split, plus the fp32 accumulator
    the output is written from; with one split and a weight of a short last block, plus the bf16 tile that its
    output is TMA-stored from)."""
    stages = min(steps, D // (split_k * block_k))
    acc = ROWS * tokens(B) * 4 if x_stream == "N" and split_k == 1 else 0
    staged = ROWS * tokens(B, x_stream) * 2 if any_ragged and split_k == 1 else 0
    return stages * (ROWS + tokens(B, x_stream)) * block_k * 2 + acc + staged


def check_supported(x_BD, ws_ND, block_k, split_k, steps=2, x_stream="N"):
    B, D = x_BD.shape
    if x_stream not in X_STREAMS:
        raise NotImplementedError(f"x_stream={x_stream!r}: one of {X_STREAMS}")
    check_operands(x_BD, ws_ND, block_k, split_k)
    need = smem_bytes(B, D, block_k, split_k, steps, x_stream, any(ragged(w.shape[0]) for w in ws_ND))
    if need > SMEM_BYTES:
        raise NotImplementedError(
            f"batch {B}: {steps} stages of weight and x tiles need {need} bytes "
            f"of SMEM (> {SMEM_BYTES}); lower steps or block_k"
        )


def check_operands(x_BD, ws_ND, block_k, split_k):
    """What every body of the GEMV takes (kernel_sm100's too): bf16, a decode batch, [N, D] weights of N a multiple
    of 8, D in split_k x block_k slices of two blocks or more."""
    B, D = x_BD.shape
    if x_BD.dtype != jnp.bfloat16 or any(w.dtype != jnp.bfloat16 for w in ws_ND):
        raise NotImplementedError(f"bf16 only: x {x_BD.dtype}, w {[str(w.dtype) for w in ws_ND]}")
    if B > MAX_TOKENS:
        raise NotImplementedError(f"batch {B} > {MAX_TOKENS}: a GEMM, not a decode GEMV (XLA's is fine there)")
    if any(w.ndim != 2 or w.shape[1] != D or w.shape[0] % TOKENS or not w.shape[0] for w in ws_ND):
        raise NotImplementedError(
            f"weights {[w.shape for w in ws_ND]}: need [N, {D}] with N a positive multiple of {TOKENS} (the TMA "
            "store of an output row needs 16-byte strides)"
        )
    if D % (split_k * block_k) or D // (split_k * block_k) < 2:
        raise NotImplementedError(
            f"D = {D} is not split_k {split_k} x block_k {block_k} x 2 or more (the "
            "pipeline releases a stage one step late, so it needs two)"
        )


def _body(x_ref, *refs, n_blocks, staged, block_k, steps, k_slabs, T, x_stream, n_tokens):
    """x_ref: x [x_rows(B), D], read in [T, block_k] tiles whose rows past x's the TMA fills with zeros. refs:
    the weights [N_i, D], then the outputs: fp32 partials [S, N_pad, T] ("M": [S, T, N_pad]; N_pad: N_i in whole
    blocks), or with one split a bf16 output itself ("M" [1, T, N_i], "N" [1, B, N_i]; staged, a weight of a
    short last block: [1, B, N_i]), then scratch: (on N, a bf16 output) the fp32 accumulator [ROWS, T] that the
    n_tokens output rows are read from, (any staged) the rounded output tile [T, ROWS] that a TMA stores."""
    n_w = len(n_blocks)
    ws, outs, scratch = refs[:n_w], refs[n_w : 2 * n_w], list(refs[2 * n_w :])
    tile_smem = scratch.pop() if any(staged) else None
    acc_smem = scratch.pop() if scratch else None
    blk, s = lax.axis_index("n"), lax.axis_index("k")
    k_range = pl.ds(s * k_slabs * block_k, k_slabs * block_k)  # this CTA's columns of D

    def run(w_ref, out_ref, stage, row_blk):
        def scope(acc_ref):
            def step(_, w_smem, x_smem):
                if x_stream == "M":  # acc [T, ROWS] += x [T, block_k] @ wᵀ [block_k, ROWS]
                    plgpu.wgmma(acc_ref, x_smem, w_smem.transpose((1, 0)))
                else:  # acc [ROWS, T] += w [ROWS, block_k] @ xᵀ [block_k, T]
                    plgpu.wgmma(acc_ref, w_smem, x_smem.transpose((1, 0)))

            # a stage: the weight's [ROWS, block_k] tile and x's [T, block_k] tile of the same K block; a short
            # last block's rows past N arrive as the TMA's zeros
            specs = [
                plgpu.BlockSpec((ROWS, block_k), lambda k: (row_blk, k), transforms=_TRANSFORMS, delay_release=1),
                plgpu.BlockSpec((T, block_k), lambda k: (0, k), transforms=_TRANSFORMS, delay_release=1),
            ]
            plgpu.emit_pipeline(step, grid=(k_slabs,), max_concurrent_steps=steps, in_specs=specs)(
                w_ref.at[:, k_range], x_ref.at[:, k_range]
            )
            return acc_ref[...]

        def store_tile():  # the rounded [T, ROWS] tile to out [1, B, N]: the TMA drops rows past B, columns past N
            plgpu.commit_smem()  # the tile's register stores, before the TMA reads it
            plgpu.copy_smem_to_gmem(tile_smem, out_ref.at[0, pl.ds(0, T), block])
            plgpu.wait_smem_to_gmem(0)

        block = pl.ds(row_blk * ROWS, ROWS)
        if x_stream == "M":  # token-major [S, T, N]; with one split the output itself (out_ref in x's dtype)
            acc = pl.run_scoped(scope, plgpu.ACC((T, ROWS), F32)).astype(out_ref.dtype)
            if stage:
                tile_smem[...] = acc
                store_tile()
            else:
                out_ref.at[s, :, block][...] = acc
        elif out_ref.dtype != F32:  # "N", one split: the output, token-major, through SMEM
            acc_smem[...] = pl.run_scoped(scope, plgpu.ACC((ROWS, T), F32))
            plgpu.commit_smem()  # a warpgroup barrier: each token's column is read by other threads
            for b in range(n_tokens):  # column b in the row layout (4 lanes a row) -> out row b, rounded once
                col = plgpu.load(acc_smem.at[:, b], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                (tile_smem.at[b] if stage else out_ref.at[0, b, block])[...] = col.astype(out_ref.dtype)
            if stage:
                store_tile()
        else:  # WGMMA layout straight to GMEM: 2 KB at T = 8
            out_ref.at[s, block][...] = pl.run_scoped(scope, plgpu.ACC((ROWS, T), F32))

    first = 0
    for w_ref, out_ref, n, stage in zip(ws, outs, n_blocks, staged, strict=True):  # which weight this block is in
        pl.when((blk >= first) & (blk < first + n))(functools.partial(run, w_ref, out_ref, stage, blk - first))
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
    return finish(parts, ws_ND, written, out_dtypes, B, x_stream)


def finish(parts, ws_ND, written, out_dtypes, B, x_stream="N"):
    """The kernel's writes -> the [B, N_i] outputs: a bf16 output the kernel wrote itself as it is, fp32 partials
    summed over the splits (their padding sliced off), rounded to out_dtypes. Shared with kernel_sm100 (the same
    layouts, other paddings)."""
    outs = []
    for p, w, w_dtype, dtype in zip(parts, ws_ND, written, out_dtypes, strict=True):
        N = w.shape[0]  # the partials' rows past N are padding (the sum's slice costs nothing: one fusion)
        if w_dtype != F32:  # [1, 64 ("M") or B ("N", or staged), N] in x's dtype
            outs.append(p[0, :B])
        elif x_stream == "M":  # token-major: no transpose, so the sum can join its consumer's fusion
            outs.append(sum_splits(p)[:B, :N].astype(dtype))
        elif B == 1:  # column 0: no transpose, so the sum can join its consumer's fusion
            outs.append(sum_splits(p)[None, :N, 0].astype(dtype))
        else:
            outs.append(p.sum(0)[:N, :B].T.astype(dtype))
    return tuple(outs)


def sum_splits(p_S___):
    """The S partials summed by chained adds, not a reduce over axis 0: elementwise adds are a loop fusion that
    XLA fuses into the output's consumer (the router's sigmoid, the shared experts' GLU), where a reduce is a
    kernel of its own. On N, batch 1 only: there it removed ~2 kernels a MoE layer (the 12-layer rank slice on an
    H100, 2026-12-05: FFN 256 -> 168 us); at batch 64 the [N, B] -> [B, N] transpose fused into the shared
    experts' GLU made it one slow 16 us kernel (FFN 275 -> 465 us), so wider batches on N keep the reduce, whose
    fusion transposes through SMEM. Token-major partials ("M") need no transpose and take the adds at any batch."""
    return functools.reduce(jnp.add, (p_S___[s] for s in range(p_S___.shape[0])))


@functools.partial(jax.jit, static_argnames=_STATIC)
def partials(x_BD, ws_ND, *, block_k=128, split_k=2, steps=6, x_stream="N", interpret=None):
    """The kernel alone: tuple of fp32 [split_k, N_pad, T] (T = tokens(B), N_pad = N_i in whole 64-row blocks),
    sum over axis 0 and column b = token b's output (columns B..T-1 and rows N_i..N_pad-1 are padding); with
    x_stream "M" token-major [split_k, 64, N_pad], row b token b's. A consumer that reads these itself (the KDA
    decode kernel) saves the glue."""
    return _partials(x_BD, ws_ND, block_k=block_k, split_k=split_k, steps=steps, x_stream=x_stream, interpret=interpret)


def _partials(x_BD, ws_ND, *, block_k, split_k, steps, x_stream, interpret, out_dtypes=None):
    """out_dtypes: what each weight's CTAs write, fp32 partials (the default) or, with one split, the output
    in x's dtype."""
    B, D = x_BD.shape
    T = tokens(B, x_stream)
    out_dtypes = out_dtypes or (F32,) * len(ws_ND)
    n_blocks = tuple(-(-w.shape[0] // ROWS) for w in ws_ND)
    # x padded only where Mosaic's TMA needs it (x_rows): an XLA pad is a kernel launch of its own
    x_TD = jnp.pad(x_BD, ((0, x_rows(B) - B), (0, 0)))
    k_slabs = D // block_k // split_k
    direct = tuple(d != F32 for d in out_dtypes)
    # a bf16 output of a short last block goes out by TMA (register stores cannot stop at N)
    staged = tuple(dr and ragged(w.shape[0]) for dr, w in zip(direct, ws_ND, strict=True))
    scratch = []
    if x_stream == "N" and any(direct):
        scratch.append(plgpu.SMEM((ROWS, T), F32))  # the accumulator, whose columns become rows
    if any(staged):
        scratch.append(plgpu.SMEM((T, ROWS), x_BD.dtype))  # the rounded output tile the TMA stores

    def out_shape(N, n, dr, stage):
        if stage:
            return (1, B, N)
        if dr:
            return (1, B, N) if x_stream == "N" else (1, T, N)
        return (split_k, T, n * ROWS) if x_stream == "M" else (split_k, n * ROWS, T)

    kernel = plgpu.kernel(
        functools.partial(
            _body,
            n_blocks=n_blocks,
            staged=staged,
            block_k=block_k,
            steps=min(steps, k_slabs),
            k_slabs=k_slabs,
            T=T,
            x_stream=x_stream,
            n_tokens=B,
        ),
        out_type=tuple(
            jax.ShapeDtypeStruct(out_shape(w.shape[0], n, dr, stage), d)
            for w, n, d, dr, stage in zip(ws_ND, n_blocks, out_dtypes, direct, staged, strict=True)
        ),
        scratch_types=scratch,
        grid=(sum(n_blocks), split_k),
        grid_names=("n", "k"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )
    return tuple(kernel(x_TD, *ws_ND))


# ---- several (x_j, w_j) pairs sharing N, summed into one output (the MoE's finish) ---------------------------
# y [B, N] = Σ_j x_j [B, K_j] @ w_jᵀ, w_j out-major [N, K_j]: one TP16 rank's latent_up (K 224) and shared_down
# (K 384) into the MoE's [T, D = 7168] partial (layers/moe.py finish; TP8: 448 and 768). Each CTA owns one
# 64-row block of N and streams every pair's slice of it through ONE pipeline, the pairs in lockstep: step k
# loads block k of every pair (pair j's tile [ROWS, bk_j] and x_j's [T, bk_j]) and issues one WGMMA per pair into
# that pair's own fp32 accumulator. The model's rule for the sum (docs/model.md §6 step 5: each product is a
# bf16 GEMM, rounded; "y_rout + y_sh is a bf16 add") is kept: each accumulator is rounded to the activation dtype,
# then the rounded products are added in order, each add rounded (a bf16 add: fp32 sum, one rounding). N whole
# 64-row blocks only (D = 7168 is 112), one split only (a split's partials would need a glue kernel to sum them
# before the rounding: the point is one launch), so the kernel writes the output itself: N = 7168 / 64 = 112 CTAs.
#
# The pairs' K differ and need not be multiples of the block width (224 = 7 x 32): a lockstep pipeline needs the
# same number of steps n for every pair, so n comes from the widest pair (n = ceil(max K / block_k)) and each
# pair's block is the multiple of its swizzle row that covers its K in n steps; the last block's columns past K_j
# are the TMA's zeros (x_j's and w_j's both: the products vanish). The TMA reads a swizzled tile as whole swizzle
# rows of the array, so K_j must be a multiple of one: each pair takes the widest swizzle whose row divides K_j
# (224: 64 bytes, 32 columns; 384, 448, 768: 128 bytes, 64 columns), the pair's weight and x tiles the same (WGMMA
# needs its operands' swizzles equal). A pair whose last block would be empty is refused (pair_blocks): TP16
# (224, 384) takes block_k 128 (3 steps of 96 + 128 columns) or 192 / 256 (2 of 128 + 192), TP8 (448, 768) 128
# (6 of 80, on a 32-byte swizzle, + 128), 192 (4 of 128 + 192) or 256 (3 of 192 + 256); block_k 64 neither.
SWIZZLES = (128, 64, 32)  # bytes; a bf16 swizzle row is half as many columns


def pair_blocks(Ks, block_k):
    """-> (n, bks, swizzles): the pipeline's steps, each pair's block width and swizzle (bytes): the widest
    swizzle whose row (swizzle / 2 columns) divides K_j and makes bk_j, the smallest multiple of that row with
    n x bk_j >= K_j, leave no empty last block ((n - 1) x bk_j < K_j); NotImplementedError where none does."""
    if block_k % (_SWIZZLE // 2):
        raise NotImplementedError(f"block_k {block_k}: a multiple of {_SWIZZLE // 2} (a 128-byte swizzle row)")
    n = -(-max(Ks) // block_k)
    bks, swizzles = [], []
    for K in Ks:
        for sw in SWIZZLES:
            g = sw // 2
            bk = -(-K // (n * g)) * g  # ceil(ceil(K / n) / g) = ceil(K / (n g))
            if K % g == 0 and (n - 1) * bk < K:
                bks.append(bk)
                swizzles.append(sw)
                break
        else:
            raise NotImplementedError(
                f"K {tuple(Ks)} in {n} lockstep steps of block_k {block_k}: K = {K} takes no block width (a multiple "
                f"of a swizzle row dividing it, {[s // 2 for s in SWIZZLES]}) without an empty last block"
            )
    return n, tuple(bks), tuple(swizzles)


def _transforms(swizzle):
    return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


def sum_smem_bytes(B, Ks, block_k, steps, x_stream="N"):
    """The pipeline's stages (every pair's weight and x tiles) and the output staging: on N the fp32 sum
    [ROWS, T] its token rows are read from, on M the rounded [T, ROWS] tile its TMA stores."""
    n, bks, _ = pair_blocks(Ks, block_k)
    T = tokens(B, x_stream)
    out = ROWS * T * (4 if x_stream == "N" else 2)
    return min(steps, n) * (ROWS + T) * sum(bks) * 2 + out


def check_sum_supported(xs_BK, ws_NK, block_k, split_k=1, steps=2, x_stream="N"):
    if x_stream not in X_STREAMS:
        raise NotImplementedError(f"x_stream={x_stream!r}: one of {X_STREAMS}")
    check_sum_operands(xs_BK, ws_NK, block_k, split_k, ROWS)
    B, n = xs_BK[0].shape[0], pair_blocks([x.shape[1] for x in xs_BK], block_k)[0]
    need = sum_smem_bytes(B, [x.shape[1] for x in xs_BK], block_k, steps, x_stream)
    if need > SMEM_BYTES:
        raise NotImplementedError(
            f"batch {B}: {min(steps, n)} stages of every pair's tiles need {need} bytes of SMEM (> {SMEM_BYTES}); "
            "lower steps or block_k"
        )


def check_sum_operands(xs_BK, ws_NK, block_k, split_k, rows):
    """What every body of the pairs' GEMV takes (kernel_sm100's too): bf16 pairs sharing B and N, a decode batch,
    N in whole `rows`-row blocks (the body's), one split, two lockstep steps or more."""
    if not xs_BK or len(xs_BK) != len(ws_NK):
        raise NotImplementedError(f"{len(xs_BK)} x's for {len(ws_NK)} weights: one x per weight")
    if any(a.dtype != jnp.bfloat16 for a in (*xs_BK, *ws_NK)):
        raise NotImplementedError(f"bf16 only: {[str(a.dtype) for a in (*xs_BK, *ws_NK)]}")
    B, N = xs_BK[0].shape[0], ws_NK[0].shape[0]
    if B > MAX_TOKENS:
        raise NotImplementedError(f"batch {B} > {MAX_TOKENS}: a GEMM, not a decode GEMV (XLA's is fine there)")
    shapes = [(x.shape, w.shape) for x, w in zip(xs_BK, ws_NK, strict=True)]
    if any(
        x.ndim != 2 or w.ndim != 2 or x.shape[0] != B or w.shape[0] != N or x.shape[1] != w.shape[1] or x.shape[1] % 8
        for x, w in zip(xs_BK, ws_NK, strict=True)
    ):
        raise NotImplementedError(
            f"pairs {shapes}: need x_j [{B}, K_j] and w_j [N, K_j] sharing B and N, K_j a multiple of 8 (the TMA's "
            "16-byte row strides)"
        )
    if N % rows:
        raise NotImplementedError(f"N = {N}: whole {rows}-row blocks only (the output is stored a block at a time)")
    if split_k != 1:
        raise NotImplementedError(f"split_k {split_k}: one split (the kernel rounds each pair's whole sum itself)")
    n = pair_blocks([x.shape[1] for x in xs_BK], block_k)[0]
    if n < 2:
        raise NotImplementedError(f"K {[x.shape[1] for x in xs_BK]} in one step of {block_k}: the pipeline needs two")


def _sum_body(*refs, bks, swizzles, n_steps, steps, T, x_stream, n_tokens, windowed):
    """refs: (windowed) the column starts of the x_j's windows [J] int32 (0 where x_j is [B, K_j] itself), the
    x_j [x_rows(B), >= K_j], the w_j [N, K_j], the output [B, N], then scratch: on N the fp32 sum [ROWS, T] (a
    token's column becomes its output row), on M the rounded [T, ROWS] tile a TMA stores."""
    J = len(bks)
    starts_ref, refs = (refs[0], refs[1:]) if windowed else (None, refs)
    xs, ws, (out_ref, staging) = refs[:J], refs[J : 2 * J], refs[2 * J :]
    blk = lax.axis_index("n")
    block = pl.ds(blk * ROWS, ROWS)

    def scope(*accs):
        def step(_, *tiles):  # each pair's weight tile, then its x tile
            for acc, w_smem, x_smem in zip(accs, tiles[::2], tiles[1::2], strict=True):
                if x_stream == "M":  # acc [T, ROWS] += x [T, bk] @ wᵀ [bk, ROWS]
                    plgpu.wgmma(acc, x_smem, w_smem.transpose((1, 0)))
                else:  # acc [ROWS, T] += w [ROWS, bk] @ xᵀ [bk, T]
                    plgpu.wgmma(acc, w_smem, x_smem.transpose((1, 0)))
            plgpu.wgmma_wait(J)  # the previous step's WGMMAs are done: their slots may be refilled (delay_release)

        specs = []
        for j, (bk, sw) in enumerate(zip(bks, swizzles, strict=True)):
            # block k of pair j: w's columns past K_j are the TMA's zeros, so x's there (its window's neighbours,
            # or the TMA's zeros past x) add nothing
            tr = _transforms(sw)
            specs.append(plgpu.BlockSpec((ROWS, bk), lambda k: (blk, k), transforms=tr, delay_release=1))
            if windowed:  # an element offset: the window's start
                x_at = lambda k, x0=starts_ref[j], bk=bk: (0, x0 + k * bk)  # noqa: E731
                specs.append(plgpu.BlockSpec((T, pl.Element(bk)), x_at, transforms=tr, delay_release=1))
            else:
                specs.append(plgpu.BlockSpec((T, bk), lambda k: (0, k), transforms=tr, delay_release=1))
        gmem = [r for pair in zip(ws, xs, strict=True) for r in pair]
        plgpu.emit_pipeline(step, grid=(n_steps,), max_concurrent_steps=steps, in_specs=specs)(*gmem)
        plgpu.wgmma_wait(0)
        return tuple(acc[...] for acc in accs)

    shape = (T, ROWS) if x_stream == "M" else (ROWS, T)
    accs = pl.run_scoped(scope, *(plgpu.ACC(shape, F32) for _ in bks))
    dtype = out_ref.dtype
    y = accs[0].astype(dtype)  # each product rounded (a bf16 GEMM), then the bf16 adds in order
    for acc in accs[1:]:
        y = (y.astype(F32) + acc.astype(dtype).astype(F32)).astype(dtype)
    if x_stream == "M":  # the [T, ROWS] tile to out [B, N]: the TMA drops the rows past B
        staging[...] = y
        plgpu.commit_smem()  # the tile's register stores, before the TMA reads it
        plgpu.copy_smem_to_gmem(staging, out_ref.at[pl.ds(0, T), block])
        plgpu.wait_smem_to_gmem(0)
    else:  # token b's column (4 lanes a row) -> out row b; the values are already rounded: exact in fp32
        staging[...] = y.astype(F32)
        plgpu.commit_smem()  # a warpgroup barrier: each token's column is read by other threads
        for b in range(n_tokens):
            col = plgpu.load(staging.at[:, b], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
            out_ref.at[b, block][...] = col.astype(dtype)


@functools.partial(jax.jit, static_argnames=_STATIC)
def gemv_sum(xs_BK, ws_NK, *, x_starts=None, block_k=192, split_k=1, steps=4, x_stream="N", interpret=None):
    """Σ_j x_j [B, K_j] @ w_jᵀ (w_j out-major [N, K_j], bf16) -> [B, N] in x's dtype, in one launch: each pair's
    product an fp32 sum rounded to x's dtype, the rounded products added in order with bf16 adds
    (reference.gemv_sum). x_starts (reference.x_windows): per pair None (x_j is [B, K_j]) or the column where
    x_j's K_j-wide window starts (traced; a multiple of 8, the TMA's 16 bytes), which the kernel's x tiles
    read from (a rank's slice of a replicated activation with no slice kernel). split_k must be 1
    (check_sum_supported)."""
    del split_k  # one split: the table's field, checked by check_sum_supported
    B, N = xs_BK[0].shape[0], ws_NK[0].shape[0]
    T = tokens(B, x_stream)
    n, bks, swizzles = pair_blocks([w.shape[1] for w in ws_NK], block_k)
    x_starts = x_starts or (None,) * len(xs_BK)
    windowed = any(x0 is not None for x0 in x_starts)  # static: x_starts' None leaves are its pytree structure
    starts = [jnp.stack([jnp.asarray(0 if x0 is None else x0, jnp.int32) for x0 in x_starts])] if windowed else []
    # x padded only where Mosaic's TMA needs it (x_rows): an XLA pad is a kernel launch of its own
    xs_TK = tuple(jnp.pad(x, ((0, x_rows(B) - B), (0, 0))) for x in xs_BK)
    dtype = xs_BK[0].dtype
    staging = plgpu.SMEM((T, ROWS), dtype) if x_stream == "M" else plgpu.SMEM((ROWS, T), F32)
    kernel = plgpu.kernel(
        functools.partial(
            _sum_body,
            bks=bks,
            swizzles=swizzles,
            n_steps=n,
            steps=min(steps, n),
            T=T,
            x_stream=x_stream,
            n_tokens=B,
            windowed=windowed,
        ),
        out_type=jax.ShapeDtypeStruct((B, N), dtype),
        scratch_types=[staging],
        grid=(N // ROWS,),
        grid_names=("n",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )
    return kernel(*starts, *xs_TK, *ws_NK)
