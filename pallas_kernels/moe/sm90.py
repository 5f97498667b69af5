"""Hopper (sm90) body of the routed experts: two grouped MXFP4 kernels that read each selected expert's bytes
once and skip the experts nobody chose, with XLA around them for the grouping, the GLU and the weighted sum.

1. grouping.py: the T x k (token, expert) pairs grouped by expert (XLA compare-sums), a static table of
   min(E, T x k) slots (expert, first row, group size; idle slots size 0) over an aligned pair order of R rows;
   z with its columns in the kernels' K order (permute_k) copied to its pairs' rows -> x [R, L].
2. gate/up kernel, grid (slot, 64-row block of I, K split): W1 and W3 rows of the block streamed over the
   split's share of K in 256-byte steps with their scale tiles [64, 16]; out the fp32 partial sums
   [splits, 2 (W1, W3), R, I]. Splitting K gives the small steps (T <= 8: 16-118 experts) enough CTAs.
3. XLA: the splits summed, h = SiTU-GLU(bf16(W1 z), bf16(W3 z)) rounded to bf16 (the spec's roundings), its
   columns put in the K order -> [R, I]. One small fusion (R x I x 4 bytes per split, against each expert's
   1.1 MB at TP16). With one split (launch fused_glu) the gate/up kernel does this itself and writes h.
4. down kernel, grid (slot, group of 64-row blocks of L): the group's W2 row blocks streamed, each over K = I
   whole, their scales read by ld.global (a W2 scale row is I/32 = 6-12 bytes: no TMA view has 16-byte
   strides); out y [R, L] in pair order, bf16 (the spec's rounding after the expert GEMM).
5. XLA finalize: the y rows back in (token, choice) order, the fp32 weighted sum over k rounded once
   (reference.combine, the same expression as the reference).

Each 64-row tile has the weight rows on WGMMA's M and the group's tokens on N (8-64 per tile, padded to 8 by
the TMA's zero fill; "swap-AB", as the decode GEMV). A group larger than a tile runs its tiles one after the
other in the same CTA (the weight tile again, from L2).

The decode (the kernels' cost: an ALU-bound ~15-17 integer instructions per weight in the first version, ncu
on the H200, bench/NOTES.md) works on 32-bit words, two weights per instruction. A thread's WGMMA A fragment
of a 64-column K chunk is 8 registers of bf16 pairs; it loads the two code words (16 codes, one scale group)
that feed them, and each register is one word's codes k and k + 4 moved into bf16 bit positions by two
shifts and two masks: (code & 7) << 6 | sign << 15 is E2M1 x 2^-126 exactly (+-0.5 a bf16 subnormal), then
two bf16x2 multiplies, by 2^126 and by the scale 2^(e - 127), give the exact value for every scale byte
e = 0..254. So the A columns come in a fixed order within each 64-element block of K (K_ORDER): the
activations of both GEMMs are put in the same order (x by XLA's gather, h by XLA's GLU fusion), and
the products are summed over the same K. On the GPU the decode is inline Mosaic GPU code (the register
moves and the bf16x2 multiplies Pallas cannot express); interpret mode, which cannot run it nor a register
A, decodes the same tile with mxfp4.e2m1_bf16 into a swizzled SMEM tile (a_in_smem), in the same K order.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe import bodies, grouping, mxfp4, reference
from pallas_kernels.moe.bodies import ROW_LAYOUT, UP_BLOCK, Launch, expert_shapes, load_row, tiled
from pallas_kernels.policy import SCALE_MAX_UNKNOWN

ARCH = "sm90"  # its tuning.json section
F32, BF16, U16 = jnp.float32, jnp.bfloat16, jnp.uint16
ROWS = 64  # WGMMA's M: weight rows per tile
CHUNK = 64  # K elements per decoded A chunk: 32 code bytes, two scale groups, four k16 WGMMAs
CHUNK_BYTES = CHUNK // 2
MAX_TOKENS_PER_TILE = 64
SMEM_BYTES = 227 * 1024  # sm90's per-CTA maximum
_LANE = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def _params(profile_dir: str = ""):
    """The kernels' compiler params; profile_dir: write Mosaic GPU's in-kernel trace of each CTA's phases there
    (jax.named_scope spans; GPU only, with a CPU device beside it: bench/moe_layer.py --profile)."""
    if not profile_dir:
        return _LANE
    return plgpu.CompilerParams(
        lowering_semantics=plgpu.LoweringSemantics.Lane,
        profile_space=256,  # in SMEM: a CTA's few spans
        profile_dir=profile_dir,
        profile_bounds_check=True,
    )


def _k_order() -> np.ndarray:
    """K_ORDER[p] = the element of a 64-element block that A's column p holds. Thread lane c of a row holds A
    columns 8G + 2c + i (G = 0..7, i = 0..1: WGMMA's fragment); it loads the block's code words 2c + q
    (q = 0, 1) and makes register G = 4q + k from word 2c + q's codes k (i = 0) and k + 4 (i = 1), so column
    p = 32q + 8k + 2c + i holds element 8 (2c + q) + k + 4i = 16c + 8q + 4i + k (one scale group per lane
    pair: c // 2)."""
    p = np.arange(CHUNK)
    q, k, c, i = p // 32, (p // 8) % 4, (p // 2) % 4, p % 2
    return 16 * c + 8 * q + 4 * i + k


K_ORDER = _k_order()


def permute_k(x):
    """x [..., K] -> its columns in the kernels' K order (K_ORDER within each 64-element block)."""
    *lead, K = x.shape
    blocks = x.reshape(*lead, K // CHUNK, 4, 2, 2, 4)  # element 16c + 8q + 4i + k: [c, q, i, k]
    return jnp.moveaxis(blocks, (-4, -3, -2, -1), (-2, -4, -1, -3)).reshape(*lead, K)  # -> [q, k, c, i]


# ------------------------------------------------------------------------------------------------ the decode


def _decode_gpu(codes_smem, s_lo, s_hi, *, chunk: int, fold: bool = False):
    """A [64, 64] bf16 in WGMMA's register layout = chunk `chunk` (32 bytes) of the codes tile [64, Kb] uint8
    (TMA-tiled (8, sw) and swizzled) decoded in K_ORDER, s_lo / s_hi: the chunk's two scale groups per row
    (ROW_LAYOUT uint8). Inline Mosaic GPU: per thread and row, one 8-byte ld.shared of its two words, 4 integer
    operations and 2 bf16x2 multiplies per register of two weights. fold (launch scale_fold): ONE multiply,
    by 2^126 x 2^(e - 127) = 2^(e - 1) as one bf16 factor, which exists for scale bytes e <= 128 only (a
    larger byte decodes to garbage: the caller vouches for its weights)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, gpu, llvm
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils

    kb = codes_smem.shape[-1]
    sw = bodies.codes_swizzle(kb)

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(tiled(sw, 1)), ROW_LAYOUT, ROW_LAYOUT),
        return_type=plgpu.ShapeDtypeStruct((ROWS, CHUNK), BF16, layout=plgpu.Layout.WGMMA),
    )
    def decode(ctx, ref, lo, hi):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        i8 = ir.IntegerType.get_signless(8)
        c = lambda v: utils.c(v, i32)  # noqa: E731
        tid = arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x))
        lane = arith.andi(tid, c(31))
        col = arith.andi(lane, c(3))  # WGMMA's c: the lane's column pair
        row0 = arith.addi(arith.muli(arith.shrui(tid, c(5)), c(16)), arith.shrui(lane, c(2)))
        base = llvm.ptrtoint(i32, utils.memref_ptr(ref))
        upper = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(col, c(2)), c(0))  # lanes 2, 3: the second group
        c126 = c(0x7E807E80)  # 2^126 in both bf16 halves
        regs = np.empty(fa.WGMMA_LAYOUT.registers_shape((ROWS, CHUNK)), dtype=object)
        for h in range(2):
            row = arith.addi(row0, c(8 * h))
            byte = arith.addi(c(chunk * CHUNK_BYTES), arith.muli(col, c(8)))  # the lane's words 2c, 2c + 1
            tile = arith.addi(arith.muli(arith.shrui(row, c(3)), c(kb // sw)), arith.divui(byte, c(sw)))
            off = arith.addi(arith.muli(tile, c(8 * sw)), arith.muli(arith.andi(row, c(7)), c(sw)))
            addr = arith.addi(base, arith.addi(off, arith.remui(byte, c(sw))))
            addr = arith.xori(addr, arith.andi(arith.shrui(addr, c(3)), c((sw // 16 - 1) << 4)))  # the TMA swizzle
            words = utils.inline_ptx("ld.shared.v2.b32 {$0, $1}, [$2];", addr, result_types=[i32, i32])
            s = arith.extui(
                i32,
                arith.select(upper, utils.bitcast(hi.registers.flat[h], i8), utils.bitcast(lo.registers.flat[h], i8)),
            )
            if fold:  # 2^(e - 1): the biased exponent e + 126, a normal bf16 for e <= 128
                bits = arith.shli(arith.addi(s, c(126)), c(7))
            else:
                bits = arith.shli(s, c(7))
                bits = arith.select(arith.cmpi(arith.CmpIPredicate.eq, s, c(0)), c(0x40), bits)  # 2^-127: subnormal
            scale = arith.ori(bits, arith.shli(bits, c(16)))
            for q, w in enumerate(words):
                for k in range(4):
                    sh = 6 - 4 * k
                    mag = arith.shli(w, c(sh)) if sh >= 0 else arith.shrui(w, c(-sh))
                    sign = arith.shli(w, c(12 - 4 * k)) if k < 3 else w
                    v = arith.ori(arith.andi(mag, c(0x01C001C0)), arith.andi(sign, c(0x80008000)))
                    if not fold:
                        v = utils.inline_ptx("mul.rn.bf16x2 $0, $1, $2;", v, c126, result_types=i32)
                    v = utils.inline_ptx("mul.rn.bf16x2 $0, $1, $2;", v, scale, result_types=i32)
                    idx = [0] * regs.ndim
                    idx[1], idx[4] = 4 * q + k, h
                    regs[tuple(idx)] = utils.bitcast(v, ir.VectorType.get((2,), ir.BF16Type.get()))
        return mgpu.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return decode(codes_smem, s_lo, s_hi)


def _decode_interpret(codes_smem, s_lo, s_hi, *, chunk: int):
    """_decode_gpu's A as an array, for interpret mode: the chunk's codes by mxfp4.e2m1_bf16 (exact for scale
    bytes >= 2), its columns in K_ORDER."""
    codes = codes_smem[:, pl.ds(chunk * CHUNK_BYTES, CHUNK_BYTES)].astype(U16)  # [64, 32]
    nib = jnp.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(ROWS, CHUNK)  # element 2b + (0 lo, 1 hi)
    terms = [mxfp4.e2m1_scale_terms(s) for s in (s_lo, s_hi)]
    exp_term = jnp.concatenate([jnp.broadcast_to(t[:, None], (ROWS, 32)) for t, _ in terms], axis=1)
    mag_mask = jnp.concatenate([jnp.broadcast_to(m[:, None], (ROWS, 32)) for _, m in terms], axis=1)
    return permute_k(mxfp4.e2m1_bf16(nib, exp_term, mag_mask))


def decode_tiles(codes_R32, scales_R2, *, interpret=None, fold=False):
    """The decode alone (tests): codes [R, 32] uint8 (one 64-element chunk per row, R % 64 == 0) and their two
    E8M0 scale groups [R, 2] -> A [R, 64] bf16 in K_ORDER, as the kernels feed it to WGMMA (fold: _decode_gpu's,
    on the GPU)."""
    R = codes_R32.shape[0]

    def body(codes_ref, scales_ref, out_ref):
        def step(idx, codes):
            rows = pl.ds(idx[0] * ROWS, ROWS)
            lo, hi = (load_row(scales_ref.at[rows, g]) for g in (0, 1))
            decode = functools.partial(_decode_gpu, fold=fold) if interpret is None else _decode_interpret
            out_ref[rows, :] = decode(codes, lo, hi, chunk=0)

        spec = plgpu.BlockSpec((ROWS, CHUNK_BYTES), lambda r: (r, 0), transforms=tiled(CHUNK_BYTES, 1))
        plgpu.emit_pipeline(step, grid=(R // ROWS,), max_concurrent_steps=2, in_specs=[spec])(codes_ref)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((R, CHUNK), BF16), compiler_params=_LANE, interpret=interpret
    )
    return kernel(codes_R32, scales_R2)


def _mma_tile(acc_ref, codes_smem, scale_row, x_smem, a_smem, *, overlap=False, fold=False):
    """acc [64, N] += W_tile @ x_tile for one K step: codes [64, Kb] uint8, scale_row(g): the step's E8M0 scale
    group g ([64], ROW_LAYOUT; Kb / 16 groups), x [N, 2 Kb] bf16 (in K_ORDER). a_smem: None (A from registers,
    decoded inline) or the [64, 64] SMEM tile A goes through (interpret mode). Without overlap each chunk's
    WGMMA is waited for before the next chunk is decoded, so one chunk's A (8 registers) is held at a time, not
    the step's 64: the gate/up kernel's 225-255 registers a thread became 107-159, faster at T = 1 / 8 by 20%
    (bench/NOTES.md). overlap: the next chunk is decoded while the last WGMMA runs (wgmma_wait(1): two chunks'
    A live), the step's last WGMMA left in flight for the caller's wait."""
    _mma_tiles([(acc_ref, codes_smem, scale_row)], x_smem, a_smem, overlap=overlap, fold=fold)


def _mma_tiles(tiles, x_smem, a_smem, *, overlap=False, fold=False):
    """_mma_tile for several (acc, codes, scale_row) tiles over the same x, their chunks interleaved (W1's chunk
    j, W3's chunk j, W1's chunk j + 1, ...): with overlap, each WGMMA runs while the other tile's chunk is
    decoded. The caller waits for the last WGMMA (wgmma_wait(0)) before it reads an accumulator."""
    overlap = overlap and a_smem is None  # interpret mode's A tile in SMEM is rewritten by the next chunk
    for j in range(tiles[0][1].shape[1] // CHUNK_BYTES):
        x = x_smem.at[:, pl.ds(j * CHUNK, CHUNK)].transpose((1, 0))
        for acc_ref, codes_smem, scale_row in tiles:
            lo, hi = scale_row(2 * j), scale_row(2 * j + 1)
            if a_smem is None:
                a = _decode_gpu(codes_smem, lo, hi, chunk=j, fold=fold)
            else:
                a_smem[...] = _decode_interpret(codes_smem, lo, hi, chunk=j)
                plgpu.commit_smem()  # the async proxy (WGMMA) reads what the threads wrote
                a = a_smem
            plgpu.wgmma(acc_ref, a, x)
            plgpu.wgmma_wait(1 if overlap else 0)


def _mma_options(launch: Launch) -> dict:
    """The launch's options of _mma_tile / _mma_tiles (mma_overlap, scale_fold), which the bodies pass down."""
    return dict(overlap=launch.mma_overlap, fold=launch.scale_fold)


# ------------------------------------------------------------------------------------------------ the launch
def pick_launch(tuning: dict, T: int, scale_max: int = SCALE_MAX_UNKNOWN) -> Launch:
    return bodies.pick_launch(tuning, ARCH, T, scale_max)


def smem_bytes(launch: Launch, I: int, L: int, a_in_smem: bool = False) -> tuple[int, int]:
    """(gate/up, down) kernels' SMEM: pipeline stages, the [64, N] fp32 tile the outputs are written from, and
    (a_in_smem) the decoded A tile."""
    N = launch.tokens_per_tile
    up_stages = min(launch.up_steps, (L // 2) // UP_BLOCK // launch.up_splits)
    up = up_stages * (2 * ROWS * UP_BLOCK + 2 * ROWS * UP_BLOCK // 16 + N * UP_BLOCK * 2 * 2)
    out = ROWS * N * 4
    a = ROWS * CHUNK * 2 if a_in_smem else 0
    return up + out + a, down_stages(launch, I, out + a) * _down_stage_bytes(launch, I) + out + a


def _down_stage_bytes(launch: Launch, I: int) -> int:
    return ROWS * I // 2 + launch.tokens_per_tile * I * 2  # a W2 row block's codes (K = I whole), the h tile


def down_stages(launch: Launch, I: int, other_bytes: int) -> int:
    """The down kernel's pipeline stages: down_steps, at most its row blocks, and as many as SMEM holds (TP1's
    K = 3072 codes rows take 96 KB a block)."""
    fit = (SMEM_BYTES - other_bytes) // _down_stage_bytes(launch, I)
    return max(1, min(launch.down_steps, launch.down_row_blocks, fit))


def check_supported(experts, z_TL, sel_Tk, launch: Launch, a_in_smem: bool = False):
    """NotImplementedError for what the kernels do not take (the api then runs the reference)."""
    bodies.check_shapes(experts, z_TL, sel_Tk, launch, down_rows=ROWS)
    _, I, L = expert_shapes(experts)
    N = launch.tokens_per_tile
    if N % 8 or not 8 <= N <= MAX_TOKENS_PER_TILE:
        raise NotImplementedError(f"tokens_per_tile {N}: a multiple of 8 in [8, {MAX_TOKENS_PER_TILE}]")
    for what, b in zip(("gate/up", "down"), smem_bytes(launch, I, L, a_in_smem), strict=True):
        if b > SMEM_BYTES:
            raise NotImplementedError(f"{what} kernel: {launch} needs {b} bytes of SMEM (> {SMEM_BYTES})")


# ------------------------------------------------------------------------------------------------ the kernels


def _rows_in_k_order_gpu(acc_F32, out_smem):
    """out_smem [64, N] fp32 (plain rows) <- acc, a WGMMA-layout [64, N] fp32 fragment, its rows put in K_ORDER:
    out_smem[p] = acc[K_ORDER[p]]. A thread holds rows 16 w + 8 h + lane // 4 (warp w, register half h), row
    r = 16c + 8q + 4i + k goes to p = 32q + 8k + 2c + i (_k_order), and each register's two columns
    8j + 2 (lane % 4) + {0, 1} are one 8-byte st.shared. Inline Mosaic GPU: a fragment's rows cannot be permuted
    in Pallas."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, gpu, llvm
    from jax.experimental.mosaic.gpu import utils

    n = out_smem.shape[-1]

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def store(ctx, acc, ref):
        del ctx
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        c = lambda v: utils.c(v, i32)  # noqa: E731
        tid = arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x))
        lane, warp = arith.andi(tid, c(31)), arith.andi(arith.shrui(tid, c(5)), c(3))
        i, k = arith.andi(arith.shrui(lane, c(4)), c(1)), arith.andi(arith.shrui(lane, c(2)), c(3))
        low = arith.ori(arith.ori(arith.shli(k, c(3)), arith.shli(warp, c(1))), i)  # p's bits of k, c, i
        col = arith.muli(arith.andi(lane, c(3)), c(2))
        base = llvm.ptrtoint(i32, utils.memref_ptr(ref))
        for idx, reg in np.ndenumerate(acc.registers):
            p = arith.ori(low, c(idx[4] << 5))  # q = the register half
            elem = arith.addi(arith.muli(p, c(n)), arith.addi(col, c(8 * idx[1])))
            addr = arith.addi(base, arith.muli(elem, c(4)))
            utils.inline_ptx("st.shared.b64 [$0], $1;", addr, utils.bitcast(reg, i64))

    store(acc_F32, out_smem)


def _store_columns(acc_F32, out_smem, out_row, *, take, n_tokens, k_order=None):
    """The [64, N] fp32 tile's column t (token t of the tile) -> out_row(t) [64] where take(t): through SMEM,
    each column read back in the row layout (a value per row) and stored as one output row. k_order: the rows
    put in K_ORDER on the way ("gpu": inline, "interpret": as an array)."""
    if k_order == "gpu":
        _rows_in_k_order_gpu(acc_F32, out_smem)
    else:
        out_smem[...] = permute_k(acc_F32.T).T if k_order else acc_F32  # no array constants in a kernel
    plgpu.commit_smem()  # a warpgroup barrier: each column is read by other threads than wrote it

    for t in range(n_tokens):

        @pl.when(take(t))
        def _(t=t):  # traced here and now: the default only tells the linter so
            dst = out_row(t)
            dst[...] = load_row(out_smem.at[:, t]).astype(dst.dtype)


def _up_body(
    table_ref, w1c, w3c, w1s, w3s, x_ref, out_ref, out_smem, *a_smem,
    n_tokens, steps, direct_k, mma, glu, k_order,
):  # fmt: skip
    """Grid (slot, row block b, K split kk). w1c / w3c [E, I, L/2] uint8, w1s / w3s [E, I, L/32], x [R, L] bf16
    (z in pair order and K_ORDER; direct_k: z itself, the tile every token) -> part [splits, 2, R, I] fp32: the
    split's W1 / W3 sums of rows 64b .. 64b + 63 for the slot's pairs (direct_k: pair s, column s // k); or,
    glu = (beta1, beta2) (one split), h [R + pad, I] bf16: SiTU-GLU of their bf16 roundings, its 64 columns of
    block b in K_ORDER (k_order: how the tile's rows are permuted, _store_columns)."""
    s, b, kk = lax.axis_index("s"), lax.axis_index("b"), lax.axis_index("kk")
    e, start, count = bodies.slot(table_ref, s, direct_k)
    n_k = w1c.shape[-1] // UP_BLOCK // (1 if glu else out_ref.shape[0])  # K steps per split
    k0 = kk * n_k
    a_smem = a_smem[0] if a_smem else None

    @pl.when(count > 0)
    def _():
        @pl.loop(0, pl.cdiv(count, n_tokens))
        def _(tile):
            row0 = start + tile * n_tokens

            def scope(acc1, acc3):
                def step(_, c1, c3, s1, s3, x):
                    tiles = [
                        (acc, c, lambda g, sc=sc: load_row(sc.at[:, g]))
                        for acc, c, sc in ((acc1, c1, s1), (acc3, c3, s3))
                    ]
                    with jax.named_scope("mma"):  # a K step's decode and WGMMAs (an in-kernel trace's span)
                        _mma_tiles(tiles, x, a_smem, **mma)
                        plgpu.wgmma_wait(0)  # the stage's buffers are released after the step

                w_spec = plgpu.BlockSpec((ROWS, UP_BLOCK), lambda k: (b, k0 + k), transforms=tiled(128, 1))
                s_spec = plgpu.BlockSpec((ROWS, UP_BLOCK // 16), lambda k: (b, k0 + k))
                x_spec = plgpu.BlockSpec(
                    (pl.Element(n_tokens), 2 * UP_BLOCK),
                    lambda k: (0 if direct_k else row0, k0 + k),
                    transforms=tiled(128),
                )
                plgpu.emit_pipeline(
                    step,
                    grid=(n_k,),
                    max_concurrent_steps=min(steps, n_k),
                    in_specs=[w_spec, w_spec, s_spec, s_spec, x_spec],
                )(w1c.at[e], w3c.at[e], w1s.at[e], w3s.at[e], x_ref)
                return acc1[...], acc3[...]

            acc = plgpu.ACC((ROWS, n_tokens), F32)
            g, u = pl.run_scoped(scope, acc, acc)
            if direct_k:  # the slot's one pair: its token's column, to its row
                take, row = (lambda t: t == s // direct_k), (lambda t: row0)
            else:
                take, row = (lambda t: tile * n_tokens + t < count), (lambda t: row0 + t)
            store = functools.partial(_store_columns, take=take, n_tokens=n_tokens)
            cols = pl.ds(b * ROWS, ROWS)
            with jax.named_scope("store"):
                if glu:
                    h = bodies.glu_in_kernel(g, u, *glu).astype(F32)
                    store(h, out_smem, lambda t: out_ref.at[row(t), cols], k_order=k_order)
                else:
                    store(g, out_smem, lambda t: out_ref.at[kk, 0, row(t), cols])
                    store(u, out_smem, lambda t: out_ref.at[kk, 1, row(t), cols])


def _down_body(table_ref, w2c, w2s, h_ref, y_ref, out_smem, *a_smem, n_tokens, steps, row_blocks, mma, direct_k):
    """Grid (slot, group r of `row_blocks` 64-row blocks of L). w2c [E, L, I/2] uint8, w2s [E, L, I/32],
    h [R, I] bf16 (in K_ORDER) -> y [R, L]: the group's rows of y for the slot's pairs. The row blocks stream
    through the pipeline, K = I whole in each (a block's 6-12 KB alone made a CTA too short to pay its setup:
    50 K CTAs of 12 K weights each at T = 64 ran at 31% of HBM)."""
    s, r = lax.axis_index("s"), lax.axis_index("r")
    e, start, count = bodies.slot(table_ref, s, direct_k)
    block = w2c.shape[-1]
    a_smem = a_smem[0] if a_smem else None

    @pl.when(count > 0)
    def _():
        @pl.loop(0, pl.cdiv(count, n_tokens))
        def _(tile):
            row0 = start + tile * n_tokens

            def step(idx, codes, h):
                rows = pl.ds((r * row_blocks + idx[0]) * ROWS, ROWS)
                _down_block(
                    codes,
                    lambda g: w2s.at[e, rows, g],
                    h,
                    lambda t: y_ref.at[row0 + t, rows],
                    take=lambda t: tile * n_tokens + t < count,
                    out_smem=out_smem,
                    a_smem=a_smem,
                    n_tokens=n_tokens,
                    mma=mma,
                    dtype=y_ref.dtype,
                )

            w_spec = plgpu.BlockSpec(
                (ROWS, block), lambda i: (r * row_blocks + i, 0), transforms=tiled(bodies.codes_swizzle(block), 1)
            )
            x_spec = plgpu.BlockSpec(
                (pl.Element(n_tokens), 2 * block), lambda i: (row0, 0), transforms=tiled(bodies.x_swizzle(2 * block))
            )
            plgpu.emit_pipeline(
                step, grid=(row_blocks,), max_concurrent_steps=min(steps, row_blocks), in_specs=[w_spec, x_spec]
            )(w2c.at[e], h_ref)


def _down_block(codes_smem, scale_ref, h_smem, out_row, *, take, out_smem, a_smem, n_tokens, mma, dtype):
    """One 64-row W2 block of the down kernel: its scale rows by ld.global (scale_ref(g): group g's [64], all
    issued before the first decode needs one), W2 h through the MMA, rounded once to the output's dtype, and
    token t's column to out_row(t) where take(t)."""
    srows = [load_row(scale_ref(g)) for g in range(codes_smem.shape[-1] // 16)]

    def product(acc):
        _mma_tile(acc, codes_smem, srows.__getitem__, h_smem, a_smem, **mma)
        plgpu.wgmma_wait(0)
        return acc[...]

    with jax.named_scope("mma"):
        y = pl.run_scoped(product, plgpu.ACC((ROWS, n_tokens), F32))
    if dtype != F32:
        y = y.astype(dtype).astype(F32)  # rounded once, before the SMEM pass
    with jax.named_scope("store"):
        _store_columns(y, out_smem, out_row, take=take, n_tokens=n_tokens)


def _a_scratch():
    return [plgpu.SMEM((ROWS, CHUNK), BF16, transforms=tiled(128))]


def gate_up(
    experts,
    table,
    x_RL,
    *,
    launch: Launch,
    rows: int,
    direct_k=0,
    interpret=None,
    a_in_smem=False,
    glu=None,
    pad=0,
    profile_dir="",
):
    """The gate/up kernel -> the fp32 partial sums [splits, 2 (W1, W3), rows, I] of W1 x and W3 x per pair row;
    with glu = (beta1, beta2) (launch fused_glu), h [rows + pad, I] bf16 in K_ORDER itself (the pad rows are
    not written: the down kernel reads them into token columns it never stores). table / x: the kernels' slot
    table (bodies.slot_table) and token rows (bodies.token_rows); direct_k: bodies.direct_k."""
    E, I, L = expert_shapes(experts)
    S, R = table.shape[1], rows
    N, splits = launch.tokens_per_tile, launch.up_splits
    out = jax.ShapeDtypeStruct((R + pad, I), BF16) if glu else jax.ShapeDtypeStruct((splits, 2, R, I), F32)
    body = functools.partial(
        _up_body,
        n_tokens=N,
        steps=launch.up_steps,
        direct_k=direct_k,
        mma=_mma_options(launch),
        glu=glu,
        k_order="gpu" if interpret is None else "interpret",
    )
    kernel = plgpu.kernel(
        body,
        out_type=out,
        scratch_types=[plgpu.SMEM((ROWS, N), F32)] + (_a_scratch() if a_in_smem else []),
        grid=(S, I // ROWS, splits),
        grid_names=("s", "b", "kk"),
        compiler_params=_params(profile_dir),
        interpret=interpret,
    )
    return kernel(table, experts["w1_codes"], experts["w3_codes"], experts["w1_scales"], experts["w3_scales"], x_RL)


def down(
    experts,
    table,
    h_RI,
    *,
    launch: Launch,
    rows: int,
    direct_k=0,
    out_dtype=BF16,
    interpret=None,
    a_in_smem=False,
    profile_dir="",
):
    """The down kernel -> y [rows, L] in pair order (out_dtype: bf16, the spec's rounding; fp32 for tests); h
    may carry rows past them (the direct form's padding)."""
    E, I, L = expert_shapes(experts)
    S, R = table.shape[1], rows
    N = launch.tokens_per_tile
    kernel = plgpu.kernel(
        functools.partial(
            _down_body,
            n_tokens=N,
            steps=down_stages(launch, I, ROWS * N * 4 + (ROWS * CHUNK * 2 if a_in_smem else 0)),
            row_blocks=launch.down_row_blocks,
            mma=_mma_options(launch),
            direct_k=direct_k,
        ),
        out_type=jax.ShapeDtypeStruct((R, L), out_dtype),
        scratch_types=[plgpu.SMEM((ROWS, N), F32)] + (_a_scratch() if a_in_smem else []),
        grid=(S, L // ROWS // launch.down_row_blocks),
        grid_names=("s", "r"),
        compiler_params=_params(profile_dir),
        interpret=interpret,
    )
    return kernel(table, experts["w2_codes"], experts["w2_scales"], h_RI)


def pair_inputs(z_TL, groups: grouping.Groups, k: int, E: int, launch: Launch, *, interpret=None):
    """z's rows for the gate/up kernel's N side (bodies.token_rows), its columns in K_ORDER."""
    return bodies.token_rows(permute_k(z_TL), groups, k, E, launch, interpret=interpret)


def glu(part, *, situ_beta, situ_linear_beta, pad_rows=0):
    """The gate/up partials [splits, 2, R, I] -> h [R + pad_rows, I] bf16 in K_ORDER (the down kernel's N side;
    pad_rows: the direct form's zero rows, bodies.pad_direct_partials). The columns are put in K_ORDER before
    the split sum (elementwise maths commutes with the permutation): XLA:GPU reads a transposed input inside the
    sum's fusion, where a transpose of its output ran as a second kernel (1.2-11 us at T = 1-512,
    bench/results/moe_layer.json)."""
    g, u = jnp.sum(permute_k(bodies.pad_direct_partials(part, pad_rows)), axis=0)
    return bodies.glu(g, u, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta)


_STATIC = ("situ_beta", "situ_linear_beta", "launch", "interpret", "a_in_smem", "out_dtype", "profile_dir")


@functools.partial(jax.jit, static_argnames=_STATIC)
def grouped(
    experts,
    z_TL,
    sel_Tk,
    *,
    situ_beta,
    situ_linear_beta,
    launch,
    interpret=None,
    a_in_smem=False,
    out_dtype=BF16,
    profile_dir="",
):
    """Grouping and both kernels -> (groups, the gate/up partials (None: fused_glu), h, y [R, L] in pair
    order): what tests check. profile_dir: each kernel's in-kernel
    trace into its subdirectory gate_up / down (which must exist; bench/moe_layer.py --profile)."""
    E = experts["w1_codes"].shape[0]
    groups = bodies.group(sel_Tk, E, launch)
    kw = dict(launch=launch, interpret=interpret, a_in_smem=a_in_smem)
    up_kw, down_kw = ({"profile_dir": f"{profile_dir}/{n}" if profile_dir else ""} for n in ("gate_up", "down"))
    T, k = sel_Tk.shape
    x = pair_inputs(z_TL, groups, k, E, launch, interpret=interpret)
    table, dk = bodies.slot_table(sel_Tk, groups, launch), bodies.direct_k(sel_Tk, launch)
    rows = bodies.num_rows(T, k, E, launch)
    pad = bodies.pad_rows(rows, dk, launch)
    beta = (situ_beta, situ_linear_beta)
    if launch.fused_glu:
        part = None
        h = gate_up(experts, table, x, rows=rows, direct_k=dk, glu=beta, pad=pad, **kw, **up_kw)
    else:
        part = gate_up(experts, table, x, rows=rows, direct_k=dk, **kw, **up_kw)
        h = glu(part, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta, pad_rows=pad)
    y = down(experts, table, h, rows=rows, out_dtype=out_dtype, direct_k=dk, **kw, **down_kw)
    return groups, part, h, y


def routed_experts(
    experts,
    z_TL,
    sel_Tk,
    w_Tk,
    *,
    situ_beta,
    situ_linear_beta,
    tuning,
    scale_max=SCALE_MAX_UNKNOWN,
    interpret=None,
    a_in_smem=None,
):
    """The api's kernel entry: y [T, L] in z's dtype, or NotImplementedError for what the kernels do not take.
    scale_max: the experts' largest scale byte (pick_launch); a_in_smem: A through SMEM (None: where interpret
    mode needs it)."""
    T, k = sel_Tk.shape
    launch = pick_launch(tuning, T, scale_max)
    a_in_smem = interpret is not None if a_in_smem is None else a_in_smem
    check_supported(experts, z_TL, sel_Tk, launch, a_in_smem)
    groups, _, _, y = grouped(
        experts,
        z_TL,
        sel_Tk,
        situ_beta=situ_beta,
        situ_linear_beta=situ_linear_beta,
        launch=launch,
        interpret=interpret,
        a_in_smem=a_in_smem,
    )
    return reference.combine(bodies.ungroup(y, groups, T, k, launch), w_Tk)
