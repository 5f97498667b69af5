"""Blackwell (sm100, GB300's 10.3 included) body of the routed experts: sm90's two grouped MXFP4 kernels with
tcgen05 MMAs (accumulators in TMEM) and the weights decoded in the natural K order. Not run on a GPU yet (no
Blackwell here): interpret-tested on CPU and lowered for CUDA under an abstract B200.

1. grouping.py: the (token, expert) pairs grouped by expert, the slot table, z copied to its pairs' rows of the
   aligned pair order -> x [R, L] (columns in their natural order: no permutation on sm100).
2. gate/up kernel, grid (slot, 64-row block b of I, K split): one 128-row MMA tile stacks W1's rows
   64b .. 64b + 63 (tile rows 0-63) over W3's same rows (tile rows 64-127), so one tcgen05 MMA of M = 128 gives
   both GEMMs; out the fp32 partials [splits, R, 2 I], the 128 values of block b (64 gate, then 64 up) together.
3. XLA: the splits summed, h = SiTU-GLU(bf16(W1 z), bf16(W3 z)) rounded to bf16 -> [R, I] (natural order).
   With one split (launch fused_glu) the gate/up kernel's epilogue does this itself (a token's gate and up
   values are its column's two halves) and writes h.
4. down kernel, grid (slot, group of 128-row blocks of L): W2's row blocks streamed in K steps of at most
   256 code bytes (TP1's K = 3072 does not fit SMEM whole at 128 rows), scales by ld.global (6-96 bytes a row:
   no TMA view), out y [R, L] bf16 in pair order.
5. XLA finalize: reference.combine over the pairs back in (token, choice) order.

Each MMA is M = 128 weight rows x N = the group's tokens in a tile (16-64, a multiple of 16: tcgen05's N at
M = 128; rows past the group are other groups' or the TMA's zero fill, never stored) x K = 64: A is the
decoded [128, 64] bf16 tile in swizzled SMEM (tcgen05 reads A from SMEM or TMEM, never registers), B the
x / h tile [N, 64] (K-major, transposed view), the accumulator [128, N] fp32 in TMEM. A is double-buffered:
the threads decode chunk j + 1 while the tensor core multiplies chunk j; each MMA arrives on its buffer's
barrier, waited before the buffer is rewritten and at the end of each pipeline step (the step's TMA buffers
are reused once it returns). The tile's sums come back by tcgen05.ld, through SMEM, one [128] row per token
to HBM.

The decode (GPU): each thread of the warpgroup holds A's WGMMA-layout fragment of one 64-row half (two rows,
columns 8G + 2c + {0, 1}: the two weights of code byte 4G + c), loads its rows' 32 code bytes with two
16-byte ld.shared, and per register converts its byte natively (cvt.rn.bf16x2.e2m1x2: low nibble -> the even
element, as the checkpoint packs them) and multiplies by the group's scale 2^(e - 127) as bf16x2 (mul.rn.bf16x2,
exact for every scale byte, subnormal results included: sm90's decode relies on the same instruction). So A
holds W's columns in their own order and the activations go in as they are. Interpret mode (no inline
Mosaic GPU there) decodes the same tile with mxfp4.e2m1_bf16 (exact for scale bytes >= 2).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe import bodies, mxfp4, reference
from pallas_kernels.moe.bodies import ROW_LAYOUT, UP_BLOCK, Launch, expert_shapes, load_row, tiled

ARCH = "sm100"
F32, BF16, U16 = jnp.float32, jnp.bfloat16, jnp.uint16
ROWS = 128  # tcgen05's M: weight rows per MMA tile (M = 64 would need N >= 128 with a 128-byte swizzle)
HALF = 64  # rows per decode call (a warpgroup's WGMMA-layout fragment); W1 / W3 rows per gate/up tile
CHUNK = 64  # K elements per MMA: one 128-byte swizzled bf16 row of A, two scale groups
CHUNK_BYTES = CHUNK // 2
DOWN_K_BYTES = 256  # the down kernel's K step at most (code bytes a row): TP1's 1536 in 6 steps
MIN_TOKENS_PER_TILE = 16  # tcgen05's N at M = 128: a multiple of 16 (PTX ISA; Mosaic GPU 0.11.2 also takes 8)
MAX_TOKENS_PER_TILE = 64
SMEM_BYTES = 227 * 1024  # sm100's per-CTA maximum (as sm90's)
COL_LAYOUT = plgpu.Layout.TCGEN05.reduce(1)  # a value per row of a [128, N] tile (tcgen05.ld's layout)
_LANE = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


# ------------------------------------------------------------------------------------------------ the decode
NATIVE_CVT_PTX = 92  # the PTX ISA (x 10) from which ptxas takes cvt.rn.bf16x2.e2m1x2 (Mosaic GPU's own cutoff)


def ptxas_isa_version() -> int:
    """The PTX ISA version (x 10) of the ptxas Mosaic GPU compiles with; 0 where none is loaded (CPU)."""
    try:
        from jax._src.lib import mosaic_gpu as mgpu_lib
    except ImportError:
        return 0
    return 0 if mgpu_lib is None else mgpu_lib._mosaic_gpu_ext._get_ptxas_isa_version()


def _decode_gpu(codes_smem, s_lo, s_hi, *, chunk: int, row0: int):
    """A half [64, 64] bf16 in WGMMA's register layout = rows row0 .. row0 + 63, chunk `chunk` (32 bytes) of
    the codes tile [rows, Kb] uint8 (TMA-tiled (8, sw) and swizzled), decoded in the natural K order; s_lo /
    s_hi: the chunk's two scale groups per row (ROW_LAYOUT uint8). Inline Mosaic GPU: per thread and row two
    16-byte ld.shared, then per register of two weights a shift, a native e2m1x2 -> bf16x2 convert and one
    bf16x2 multiply by the scale; with a ptxas before PTX 9.2 (no bf16x2 destination for that convert) sm90's
    integer construction of E2M1 x 2^-126 and two bf16x2 multiplies (by 2^126, by the scale) instead."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, gpu, llvm
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils

    kb = codes_smem.shape[-1]
    sw = bodies.codes_swizzle(kb)
    native = ptxas_isa_version() >= NATIVE_CVT_PTX

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(tiled(sw, 1)), ROW_LAYOUT, ROW_LAYOUT),
        return_type=plgpu.ShapeDtypeStruct((HALF, CHUNK), BF16, layout=plgpu.Layout.WGMMA),
    )
    def decode(ctx, ref, lo, hi):
        del ctx
        i32, i16, i8 = (ir.IntegerType.get_signless(b) for b in (32, 16, 8))
        c = lambda v: utils.c(v, i32)  # noqa: E731
        tid = arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x))
        lane = arith.andi(tid, c(31))
        col = arith.andi(lane, c(3))  # WGMMA's c: the lane's column pair, i.e. byte c of each code word
        shift = arith.muli(col, c(8))
        first = arith.addi(arith.muli(arith.shrui(arith.andi(tid, c(127)), c(5)), c(16)), arith.shrui(lane, c(2)))
        base = llvm.ptrtoint(i32, utils.memref_ptr(ref))
        regs = np.empty(fa.WGMMA_LAYOUT.registers_shape((HALF, CHUNK)), dtype=object)
        for h in range(2):
            row = arith.addi(first, c(row0 + 8 * h))
            words = []
            for unit in range(2):  # the chunk's two 16-byte units of the row (a swizzle moves whole units)
                byte = chunk * CHUNK_BYTES + 16 * unit
                tile = arith.addi(arith.muli(arith.shrui(row, c(3)), c(kb // sw)), c(byte // sw))
                off = arith.addi(arith.muli(tile, c(8 * sw)), arith.muli(arith.andi(row, c(7)), c(sw)))
                addr = arith.addi(base, arith.addi(off, c(byte % sw)))
                addr = arith.xori(addr, arith.andi(arith.shrui(addr, c(3)), c((sw // 16 - 1) << 4)))  # TMA swizzle
                words += utils.inline_ptx("ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", addr, result_types=[i32] * 4)
            scales = []
            for s in (lo, hi):
                e = arith.extui(i32, utils.bitcast(s.registers.flat[h], i8))
                bits = arith.select(arith.cmpi(arith.CmpIPredicate.eq, e, c(0)), c(0x40), arith.shli(e, c(7)))
                scales.append(arith.ori(bits, arith.shli(bits, c(16))))  # 2^(e - 127) in both bf16 halves
            for g, w in enumerate(words):  # register G: byte c of word G holds columns 8G + 2c and 8G + 2c + 1
                t = arith.shrui(w, shift)
                if native:
                    v = utils.inline_ptx(
                        "{ .reg .b8 p; .reg .b32 r; mov.b16 {p, _}, $1; cvt.rn.bf16x2.e2m1x2 r, p; "
                        "mul.rn.bf16x2 $0, r, $2; }",
                        arith.trunci(i16, t),
                        scales[g // 4],
                        result_types=i32,
                    )
                else:  # sm90's bits: (code & 7) << 6 | sign << 15 is E2M1 x 2^-126 exactly, per half
                    parts = [(6, 0x1C0), (12, 0x8000), (18, 0x01C00000), (24, 0x80000000)]
                    v = functools.reduce(arith.ori, [arith.andi(arith.shli(t, c(sh)), c(m)) for sh, m in parts])
                    v = utils.inline_ptx("mul.rn.bf16x2 $0, $1, $2;", v, c(0x7E807E80), result_types=i32)  # 2^126
                    v = utils.inline_ptx("mul.rn.bf16x2 $0, $1, $2;", v, scales[g // 4], result_types=i32)
                idx = [0] * regs.ndim
                idx[1], idx[4] = g, h
                regs[tuple(idx)] = utils.bitcast(v, ir.VectorType.get((2,), ir.BF16Type.get()))
        return mgpu.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return decode(codes_smem, s_lo, s_hi)


def _decode_interpret(codes_smem, s_lo, s_hi, *, chunk: int, row0: int):
    """_decode_gpu's A half as an array, for interpret mode: mxfp4.e2m1_bf16 of the chunk's codes, natural K
    order (element 2b the low nibble of byte b)."""
    codes = codes_smem[pl.ds(row0, HALF), pl.ds(chunk * CHUNK_BYTES, CHUNK_BYTES)].astype(U16)  # [64, 32]
    nib = jnp.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(HALF, CHUNK)
    terms = [mxfp4.e2m1_scale_terms(s) for s in (s_lo, s_hi)]
    exp_term = jnp.concatenate([jnp.broadcast_to(t[:, None], (HALF, 32)) for t, _ in terms], axis=1)
    mag_mask = jnp.concatenate([jnp.broadcast_to(m[:, None], (HALF, 32)) for _, m in terms], axis=1)
    return mxfp4.e2m1_bf16(nib, exp_term, mag_mask)


def _decoder(interpret):
    return _decode_gpu if interpret is None else _decode_interpret


def decode_tiles(codes_R32, scales_R2, *, interpret=None):
    """The decode alone (tests): codes [R, 32] uint8 (one 64-element chunk per row, R % 64 == 0) and their two
    E8M0 scale groups [R, 2] -> A [R, 64] bf16 in the natural K order, as the kernels write it for tcgen05."""
    R = codes_R32.shape[0]
    decode = _decoder(interpret)

    def body(codes_ref, scales_ref, out_ref):
        def step(idx, codes):
            rows = pl.ds(idx[0] * HALF, HALF)
            lo, hi = (load_row(scales_ref.at[rows, g]) for g in (0, 1))
            out_ref[rows, :] = decode(codes, lo, hi, chunk=0, row0=0)

        spec = plgpu.BlockSpec((HALF, CHUNK_BYTES), lambda r: (r, 0), transforms=tiled(CHUNK_BYTES, 1))
        plgpu.emit_pipeline(step, grid=(R // HALF,), max_concurrent_steps=2, in_specs=[spec])(codes_ref)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((R, CHUNK), BF16), compiler_params=_LANE, interpret=interpret
    )
    return kernel(codes_R32, scales_R2)


# --------------------------------------------------------------------------------------------- the MMA step
@dataclasses.dataclass(frozen=True)
class Mma:
    """A kernel's tcgen05 resources: the TMEM accumulator [128, N], the two decoded A tiles [2, 128, 64] bf16 and
    their MMA-completion barriers."""

    acc: object
    a_smem: object
    done: object


def _mma_step(mma: Mma, halves, x_smem, *, first, decode):
    """acc (+)= A @ x^T over one step's K: halves = [(codes ref, row0, scale_rows)] for A's rows 0-63 and 64-127
    (scale_rows: the step's per-group E8M0 rows, [64] each in ROW_LAYOUT), x [N, 64 chunks] bf16. `first`
    (bool array): the step starts the tile (the accumulator is overwritten). Returns once every MMA of the step
    has finished reading its A tile and x."""
    n_chunks = x_smem.shape[1] // CHUNK
    for j in range(n_chunks):
        slot = j % 2
        if j >= 2:
            plgpu.barrier_wait(mma.done.at[slot])  # MMA j - 2 has read this A tile
        for h, (codes, row0, scale_rows) in enumerate(halves):
            a = decode(codes, scale_rows[2 * j], scale_rows[2 * j + 1], chunk=j, row0=row0)
            mma.a_smem[slot, pl.ds(h * HALF, HALF), :] = a
        plgpu.commit_smem()  # the tensor core (async proxy) reads what every thread wrote
        x = x_smem.at[:, pl.ds(j * CHUNK, CHUNK)].transpose((1, 0))
        accumulate = jnp.logical_not(first) if j == 0 else True
        plgpu.tcgen05_mma(mma.acc, mma.a_smem.at[slot], x, mma.done.at[slot], accumulate=accumulate)
    for j in range(max(0, n_chunks - 2), n_chunks):
        plgpu.barrier_wait(mma.done.at[j % 2])


def _store_columns(mma: Mma, out_smem, out_row, *, take, n_tokens, round_to=None):
    """The accumulator [128, N]'s column t (token t of the tile) -> out_row(t) [128] where take(t): tcgen05.ld
    into registers, through SMEM, each column read back a value per row. round_to: a dtype the sums are rounded
    to first (the spec's bf16 after the expert GEMM)."""
    acc = plgpu.async_load_tmem(mma.acc)
    plgpu.wait_load_tmem()  # the next tile's first MMA overwrites the accumulator
    if round_to is not None:
        acc = acc.astype(round_to).astype(F32)
    out_smem[...] = acc
    plgpu.commit_smem()  # a warpgroup barrier: each column is read by other threads than wrote it

    for t in range(n_tokens):

        @pl.when(take(t))
        def _(t=t):
            dst = out_row(t)
            dst[...] = plgpu.load(out_smem.at[:, t], layout=COL_LAYOUT, optimized=False).astype(dst.dtype)


def _store_glu_columns(mma: Mma, out_smem, out_row, *, take, n_tokens, betas):
    """The gate/up accumulator [128, N] (rows 0-63 W1 x, 64-127 W3 x) -> token t's h = SiTU-GLU of its column's
    halves (bodies.glu_in_kernel) -> out_row(t) [64] bf16 where take(t): as _store_columns, the halves read
    back a value per row."""
    acc = plgpu.async_load_tmem(mma.acc)
    plgpu.wait_load_tmem()
    out_smem[...] = acc
    plgpu.commit_smem()

    for t in range(n_tokens):

        @pl.when(take(t))
        def _(t=t):
            g, u = (load_row(out_smem.at[pl.ds(h * HALF, HALF), t]) for h in (0, 1))
            out_row(t)[...] = bodies.glu_in_kernel(g, u, *betas)


# ------------------------------------------------------------------------------------------------ the launch
def pick_launch(tuning: dict, T: int) -> Launch:
    return bodies.pick_launch(tuning, ARCH, T)


def down_k_bytes(I: int) -> int:
    """The down kernel's K step (code bytes a row): K = I whole up to DOWN_K_BYTES, else the widest multiple of
    CHUNK_BYTES at most that which divides I / 2."""
    kb = I // 2
    if kb <= DOWN_K_BYTES:
        return kb
    return max(b for b in range(CHUNK_BYTES, DOWN_K_BYTES + 1, CHUNK_BYTES) if kb % b == 0)


def _fixed_bytes(N: int) -> int:
    return 2 * ROWS * CHUNK * 2 + ROWS * N * 4  # the two A tiles, the [128, N] fp32 tile of the epilogue


def up_stages(launch: Launch, L: int) -> int:
    return min(launch.up_steps, (L // 2) // UP_BLOCK // launch.up_splits)


def _up_stage_bytes(N: int) -> int:
    return 2 * HALF * UP_BLOCK + 2 * HALF * UP_BLOCK // 16 + N * UP_BLOCK * 2 * 2  # W1 + W3 codes, scales, x


def _down_stage_bytes(N: int, I: int) -> int:
    kb = down_k_bytes(I)
    return ROWS * kb + N * kb * 2 * 2  # a W2 block's codes of the K step, the h tile


def down_stages(launch: Launch, I: int) -> int:
    """down_steps, at most the CTA's (row block, K step) steps, and as many as SMEM holds."""
    N = launch.tokens_per_tile
    steps = launch.down_row_blocks * (I // 2 // down_k_bytes(I))
    fit = (SMEM_BYTES - _fixed_bytes(N)) // _down_stage_bytes(N, I)
    return max(1, min(launch.down_steps, steps, fit))


def smem_bytes(launch: Launch, I: int, L: int) -> tuple[int, int]:
    """(gate/up, down) kernels' SMEM: pipeline stages, the A tiles and the epilogue tile."""
    N = launch.tokens_per_tile
    up = up_stages(launch, L) * _up_stage_bytes(N) + _fixed_bytes(N)
    return up, down_stages(launch, I) * _down_stage_bytes(N, I) + _fixed_bytes(N)


def check_supported(experts, z_TL, sel_Tk, launch: Launch):
    """NotImplementedError for what the kernels do not take (the api then runs the reference)."""
    bodies.check_shapes(experts, z_TL, sel_Tk, launch, down_rows=ROWS)
    _, I, L = expert_shapes(experts)
    N = launch.tokens_per_tile
    lo = MIN_TOKENS_PER_TILE
    if N % lo or not lo <= N <= MAX_TOKENS_PER_TILE:
        raise NotImplementedError(f"tokens_per_tile {N}: tcgen05's N at M = 128, a multiple of {lo} in [{lo}, 64]")
    for what, b in zip(("gate/up", "down"), smem_bytes(launch, I, L), strict=True):
        if b > SMEM_BYTES:
            raise NotImplementedError(f"{what} kernel: {launch} needs {b} bytes of SMEM (> {SMEM_BYTES})")


# ------------------------------------------------------------------------------------------------ the kernels
def _scratch(N: int):
    return [
        plgpu.TMEM((ROWS, N), F32),
        plgpu.SMEM((2, ROWS, CHUNK), BF16, transforms=tiled(128)),
        plgpu.Barrier(num_arrivals=1, num_barriers=2, orders_tensor_core=True),
        plgpu.SMEM((ROWS, N), F32),
    ]


def _up_body(
    table_ref,
    w1c,
    w3c,
    w1s,
    w3s,
    x_ref,
    out_ref,
    acc,
    a_smem,
    done,
    out_smem,
    *,
    n_tokens,
    steps,
    decode,
    direct_k,
    glu,
):
    """Grid (slot, row block b, K split kk). w1c / w3c [E, I, L/2] uint8, w1s / w3s [E, I, L/32], x [R, L] bf16
    (z in pair order; direct_k: z itself, the tile every token) -> part [splits, R, 2 I] fp32: columns
    128 b .. 128 b + 63 the split's W1 sums of rows 64 b .. 64 b + 63 for the slot's pairs (direct_k: pair s,
    column s // k), the next 64 their W3 sums; or, glu = (beta1, beta2) (one split), h [R + pad, I] bf16:
    columns 64 b .. 64 b + 63 SiTU-GLU of those sums' bf16 roundings."""
    s, b, kk = lax.axis_index("s"), lax.axis_index("b"), lax.axis_index("kk")
    e, start, count = bodies.slot(table_ref, s, direct_k)
    n_k = w1c.shape[-1] // UP_BLOCK // (1 if glu else out_ref.shape[0])  # K steps per split
    k0 = kk * n_k
    mma = Mma(acc, a_smem, done)

    @pl.when(count > 0)
    def _():
        @pl.loop(0, pl.cdiv(count, n_tokens))
        def _(tile):
            row0 = start + tile * n_tokens
            x_row0 = 0 if direct_k else row0

            def step(idx, c1, c3, s1, s3, x):
                rows = [[load_row(sc.at[:, g]) for g in range(UP_BLOCK // 16)] for sc in (s1, s3)]
                _mma_step(mma, [(c1, 0, rows[0]), (c3, 0, rows[1])], x, first=idx[0] == 0, decode=decode)

            w_spec = plgpu.BlockSpec((HALF, UP_BLOCK), lambda k: (b, k0 + k), transforms=tiled(128, 1))
            s_spec = plgpu.BlockSpec((HALF, UP_BLOCK // 16), lambda k: (b, k0 + k))
            x_spec = plgpu.BlockSpec(
                (pl.Element(n_tokens), 2 * UP_BLOCK), lambda k: (x_row0, k0 + k), transforms=tiled(128)
            )
            plgpu.emit_pipeline(
                step,
                grid=(n_k,),
                max_concurrent_steps=min(steps, n_k),
                in_specs=[w_spec, w_spec, s_spec, s_spec, x_spec],
            )(w1c.at[e], w3c.at[e], w1s.at[e], w3s.at[e], x_ref)
            if direct_k:  # the slot's one pair: its token's column, to its row
                take, row = (lambda t: t == s // direct_k), (lambda t: row0)
            else:
                take, row = (lambda t: tile * n_tokens + t < count), (lambda t: row0 + t)
            if glu:
                out_row = lambda t: out_ref.at[row(t), pl.ds(b * HALF, HALF)]  # noqa: E731
                _store_glu_columns(mma, out_smem, out_row, take=take, n_tokens=n_tokens, betas=glu)
            else:
                out_row = lambda t: out_ref.at[kk, row(t), pl.ds(b * ROWS, ROWS)]  # noqa: E731
                _store_columns(mma, out_smem, out_row, take=take, n_tokens=n_tokens)


def _down_body(
    table_ref, w2c, w2s, h_ref, y_ref, acc, a_smem, done, out_smem, *, n_tokens, steps, row_blocks, decode, direct_k
):
    """Grid (slot, group r of `row_blocks` 128-row blocks of L). w2c [E, L, I/2] uint8, w2s [E, L, I/32],
    h [R, I] bf16 -> y [R, L]: the group's rows of y for the slot's pairs. The pipeline walks (row block,
    K step); the last K step of a block writes its rows."""
    s, r = lax.axis_index("s"), lax.axis_index("r")
    e, start, count = bodies.slot(table_ref, s, direct_k)
    I = h_ref.shape[-1]
    kb = down_k_bytes(I)
    n_k = I // 2 // kb
    mma = Mma(acc, a_smem, done)
    round_to = None if y_ref.dtype == F32 else y_ref.dtype

    @pl.when(count > 0)
    def _():
        @pl.loop(0, pl.cdiv(count, n_tokens))
        def _(tile):
            row0 = start + tile * n_tokens

            def step(idx, codes, h):
                block, ks = idx
                first = (r * row_blocks + block) * ROWS
                # ld.global of the step's scale rows (both halves), all issued before the first decode needs one
                groups = [ks * (kb // 16) + g for g in range(kb // 16)]
                halves = [
                    (codes, HALF * i, [load_row(w2s.at[e, pl.ds(first + HALF * i, HALF), g]) for g in groups])
                    for i in range(2)
                ]
                _mma_step(mma, halves, h, first=ks == 0, decode=decode)

                @pl.when(ks == n_k - 1)
                def _():
                    _store_columns(
                        mma,
                        out_smem,
                        lambda t: y_ref.at[row0 + t, pl.ds(first, ROWS)],
                        take=lambda t: tile * n_tokens + t < count,
                        n_tokens=n_tokens,
                        round_to=round_to,
                    )

            w_spec = plgpu.BlockSpec(
                (ROWS, kb), lambda i, k: (r * row_blocks + i, k), transforms=tiled(bodies.codes_swizzle(kb), 1)
            )
            x_spec = plgpu.BlockSpec(
                (pl.Element(n_tokens), 2 * kb), lambda i, k: (row0, k), transforms=tiled(bodies.x_swizzle(2 * kb))
            )
            plgpu.emit_pipeline(step, grid=(row_blocks, n_k), max_concurrent_steps=steps, in_specs=[w_spec, x_spec])(
                w2c.at[e], h_ref
            )


def gate_up(experts, table, x_RL, *, launch: Launch, rows: int, direct_k=0, interpret=None, glu=None, pad=0):
    """The gate/up kernel -> the fp32 partial sums [splits, rows, 2 I] (per 64-row block: its W1 x, then W3 x);
    with glu = (beta1, beta2) (launch fused_glu), h [rows + pad, I] bf16 itself (the pad rows are not written:
    the down kernel reads them into token columns it never stores). table / x: the kernels' slot table
    (bodies.slot_table) and token rows (bodies.token_rows); direct_k: bodies.direct_k."""
    E, I, L = expert_shapes(experts)
    S, R = table.shape[1], rows
    N, splits = launch.tokens_per_tile, launch.up_splits
    out = jax.ShapeDtypeStruct((R + pad, I), BF16) if glu else jax.ShapeDtypeStruct((splits, R, 2 * I), F32)
    kernel = plgpu.kernel(
        functools.partial(
            _up_body, n_tokens=N, steps=up_stages(launch, L), decode=_decoder(interpret), direct_k=direct_k, glu=glu
        ),
        out_type=out,
        scratch_types=_scratch(N),
        grid=(S, I // HALF, splits),
        grid_names=("s", "b", "kk"),
        compiler_params=_LANE,
        interpret=interpret,
    )
    return kernel(table, experts["w1_codes"], experts["w3_codes"], experts["w1_scales"], experts["w3_scales"], x_RL)


def down(experts, table, h_RI, *, launch: Launch, rows: int, direct_k=0, out_dtype=BF16, interpret=None):
    """The down kernel -> y [rows, L] in pair order (out_dtype: bf16, the spec's rounding; fp32 for tests); h
    may carry rows past them (the direct form's padding)."""
    E, I, L = expert_shapes(experts)
    S, R = table.shape[1], rows
    N = launch.tokens_per_tile
    kernel = plgpu.kernel(
        functools.partial(
            _down_body,
            n_tokens=N,
            steps=down_stages(launch, I),
            row_blocks=launch.down_row_blocks,
            decode=_decoder(interpret),
            direct_k=direct_k,
        ),
        out_type=jax.ShapeDtypeStruct((R, L), out_dtype),
        scratch_types=_scratch(N),
        grid=(S, L // ROWS // launch.down_row_blocks),
        grid_names=("s", "r"),
        compiler_params=_LANE,
        interpret=interpret,
    )
    return kernel(table, experts["w2_codes"], experts["w2_scales"], h_RI)


def gate_up_sums(part):
    """The gate/up partials [splits, R, 2 I] -> (W1 x, W3 x), each [R, I] fp32: the splits summed."""
    splits, R, I2 = part.shape
    gu = jnp.sum(part, axis=0).reshape(R, I2 // ROWS, 2, HALF)
    return gu[:, :, 0].reshape(R, -1), gu[:, :, 1].reshape(R, -1)


def glu(part, *, situ_beta, situ_linear_beta, pad_rows=0):
    """The gate/up partials -> h [R + pad_rows, I] bf16 (the down kernel's N side, natural order; pad_rows: the
    direct form's zero rows, bodies.pad_direct_partials)."""
    g, u = gate_up_sums(bodies.pad_direct_partials(part, pad_rows))
    return bodies.glu(g, u, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta)


_STATIC = ("situ_beta", "situ_linear_beta", "launch", "interpret", "out_dtype")


@functools.partial(jax.jit, static_argnames=_STATIC)
def grouped(experts, z_TL, sel_Tk, *, situ_beta, situ_linear_beta, launch, interpret=None, out_dtype=BF16):
    """Grouping and both kernels -> (groups, the gate/up partials (None: fused_glu), h, y [R, L] in pair order):
    what tests check."""
    E = experts["w1_codes"].shape[0]
    groups = bodies.group(sel_Tk, E, launch)
    T, k = sel_Tk.shape
    x = bodies.token_rows(z_TL, groups, k, E, launch, interpret=interpret)
    table, dk = bodies.slot_table(sel_Tk, groups, launch), bodies.direct_k(sel_Tk, launch)
    kw = dict(launch=launch, direct_k=dk, interpret=interpret)
    rows = bodies.num_rows(T, k, E, launch)
    pad = bodies.pad_rows(rows, dk, launch)
    if launch.fused_glu:
        part = None
        h = gate_up(experts, table, x, rows=rows, glu=(situ_beta, situ_linear_beta), pad=pad, **kw)
    else:
        part = gate_up(experts, table, x, rows=rows, **kw)
        h = glu(part, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta, pad_rows=pad)
    y = down(experts, table, h, rows=rows, out_dtype=out_dtype, **kw)
    return groups, part, h, y


def routed_experts(experts, z_TL, sel_Tk, w_Tk, *, situ_beta, situ_linear_beta, tuning, scale_max=None, interpret=None):
    """The api's kernel entry: y [T, L] in z's dtype, or NotImplementedError for what the kernels do not take.
    scale_max: unused (sm100 decodes without scale_fold)."""
    del scale_max
    T, k = sel_Tk.shape
    launch = pick_launch(tuning, T)
    check_supported(experts, z_TL, sel_Tk, launch)
    beta = dict(situ_beta=situ_beta, situ_linear_beta=situ_linear_beta)
    groups, _, _, y = grouped(experts, z_TL, sel_Tk, **beta, launch=launch, interpret=interpret)
    return reference.combine(bodies.ungroup(y, groups, T, k, launch), w_Tk)
