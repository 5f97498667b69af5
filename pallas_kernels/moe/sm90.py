"""Hopper (sm90) body of the routed experts: two grouped MXFP4 kernels that read each selected expert's bytes
once and skip the experts nobody chose, with XLA around them for the grouping and the final weighted sum.

1. XLA (grouping.py): the T x k (token, expert) pairs sorted by expert, a static table of min(E, T x k) slots
   (expert, first sorted pair, group size; idle slots size 0), z's even and odd columns gathered in pair
   order x [2, P, L/2] (P = T x k).
2. gate/up kernel, grid (slot, parity, row block): W1 and W3 rows 2i + parity, i in a 64-row block (a free
   reshape [E, I/2, 2, L/2] picks them in one TMA box), streamed over K in 256-byte steps with their scale
   tiles [64, 16]; out h [2, P, I/2 (padded to 64s)] bf16 = SiTU-GLU(bf16(W1 z), bf16(W3 z)), the parity
   index first: h[p, pair, i] = h_pair[2i + p], so the down kernel's even and odd inputs are two plain tiles.
3. down kernel, grid (slot, 64-row block of L): W2's rows over K = I/2 bytes (one step at TP16 / TP8), its
   scales read by ld.global (a W2 scale row is I/32 = 6-12 bytes: no TMA view has 16-byte strides); out
   y [P, L] in pair order, bf16 (the spec's rounding after the expert GEMM).
4. XLA finalize: the y rows back in (token, choice) order, the fp32 weighted sum over k rounded once
   (reference.combine, the same expression as the reference). It costs 2 x P x L x 2 bytes (the kernel's
   write and XLA's read: 0.23 MB at T = 1, 117 MB at T = 512 against 985 MB of TP16 weights).

Each 64-row tile has the weight rows on WGMMA's M and the group's tokens on N (8-64 per tile, padded to 8 by
the TMA's zero fill; "swap-AB", as the decode GEMV). A group larger than a tile runs its tiles one after the
other in the same CTA (the weight tile again, from L2). MXFP4 -> bf16 happens in registers and exactly
(mxfp4.e2m1_bf16: integer bit building, no float multiply, so no flush to zero): a [64, 16·n] byte block's
low nibbles are the even elements of its n groups and its high nibbles the odd ones, so they decode as two
bf16 A operands that meet x's even and odd columns, one scale per (row, 16-byte group). On the GPU the A
operand goes from registers (plgpu.wgmma(acc, a_regs, b_smem)); interpret mode cannot run a register A, so
there it goes through a swizzled SMEM tile (a_in_smem), the decode being the same code.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.moe import grouping, mxfp4, reference

F32, BF16, U16 = jnp.float32, jnp.bfloat16, jnp.uint16
ROWS = 64  # WGMMA's M: weight rows per tile
GROUP_BYTES = mxfp4.GROUP // 2  # codes bytes per scale
UP_BLOCK = 256  # codes bytes per K step of W1/W3: its scale tile [64, 16] is the TMA's 16-byte minimum
DOWN_MAX_BLOCK = 256  # codes bytes per K step of W2 (the whole I/2 = 96 / 192 at TP16 / TP8)
MAX_TOKENS_PER_TILE = 64
SMEM_BYTES = 227 * 1024  # sm90's per-CTA maximum
ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)  # a value per accumulator row
_LANE = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


@dataclasses.dataclass(frozen=True)
class Launch:
    tokens_per_tile: int  # WGMMA's N: a group's tokens per tile (8..64, a multiple of 8)
    up_steps: int  # pipeline stages in flight in the gate/up kernel
    down_steps: int  # ... in the down kernel (its K steps: 1 at TP16 / TP8)


def pick_launch(tuning: dict, T: int) -> Launch:
    """tuning.json's sm90 launch for T tokens: the first entry whose max_tokens covers T."""
    entries = tuning["sm90"]["launch"]
    entry = next((e for e in entries if T <= e["max_tokens"]), None)
    if entry is None:
        raise NotImplementedError(
            f"T = {T} tokens: no routed-experts launch in tuning.json (it serves up to {entries[-1]['max_tokens']})"
        )
    return Launch(entry["tokens_per_tile"], entry["up_steps"], entry["down_steps"])


def _swizzle(k_elems: int) -> int:
    """The widest swizzle (bytes) whose bf16 row (swizzle / 2 elements) divides k: WGMMA's K per A chunk."""
    for sw in (128, 64, 32):
        if k_elems % (sw // 2) == 0:
            return sw
    raise NotImplementedError(f"K = {k_elems} elements per parity is not a multiple of 16")


def _tiled(sw: int):
    return (plgpu.TilingTransform((8, sw // 2)), plgpu.SwizzleTransform(sw))


def _down_block(I2: int) -> int:
    return I2 if I2 <= DOWN_MAX_BLOCK else DOWN_MAX_BLOCK


def _shapes(experts):
    E, I, L2 = experts["w1_codes"].shape
    return E, I, 2 * L2


def smem_bytes(launch: Launch, I: int, L: int, a_in_smem: bool = False) -> tuple[int, int]:
    """(gate/up, down) kernels' SMEM: pipeline stages, the [64, N] fp32 tile the outputs are written from, and
    (a_in_smem) the two decoded A chunks."""
    N = launch.tokens_per_tile
    up_stages = min(launch.up_steps, (L // 2) // UP_BLOCK)
    up = up_stages * (2 * ROWS * UP_BLOCK + 2 * ROWS * GROUP_BYTES + 2 * N * UP_BLOCK * 2)
    blk = _down_block(I // 2)
    down = min(launch.down_steps, (I // 2) // blk) * (ROWS * blk + 2 * N * blk * 2)
    out = ROWS * N * 4
    a_up = 2 * ROWS * (_swizzle(UP_BLOCK) // 2) * 2 if a_in_smem else 0
    a_down = 2 * ROWS * (_swizzle(blk) // 2) * 2 if a_in_smem else 0
    return up + out + a_up, down + out + a_down


def check_supported(experts, z_TL, sel_Tk, launch: Launch, a_in_smem: bool = False):
    """NotImplementedError for what the kernels do not take (the api then runs the reference)."""
    if "w1_codes" not in experts:
        raise NotImplementedError("dense (bf16) experts: the kernel reads MXFP4 codes + scales")
    if z_TL.dtype != BF16:
        raise NotImplementedError(f"z is {z_TL.dtype}: the kernel takes bf16 activations (WGMMA's A from registers)")
    E, I, L = _shapes(experts)
    T, k = sel_Tk.shape
    if T == 0:
        raise NotImplementedError("no tokens")
    if z_TL.shape != (T, L):
        raise NotImplementedError(f"z {list(z_TL.shape)} does not match the experts' latent width {L}")
    for name, shape in (("w3", (E, I, L // 2)), ("w2", (E, L, I // 2))):
        if experts[name + "_codes"].shape != shape:
            raise NotImplementedError(f"{name}_codes {experts[name + '_codes'].shape}: expected {shape}")
    if (L // 2) % UP_BLOCK:
        raise NotImplementedError(f"latent width {L}: W1/W3 stream in {UP_BLOCK}-byte K steps (L % 512 == 0)")
    I2 = I // 2
    if I % mxfp4.GROUP or (I2 > DOWN_MAX_BLOCK and I2 % DOWN_MAX_BLOCK):
        raise NotImplementedError(
            f"intermediate {I}: W2 streams its K = I/2 = {I2} bytes whole up to {DOWN_MAX_BLOCK}, else in "
            f"{DOWN_MAX_BLOCK}-byte steps"
        )
    if L % ROWS:
        raise NotImplementedError(f"latent width {L} is not a multiple of {ROWS} rows")
    N = launch.tokens_per_tile
    if N % 8 or not 8 <= N <= MAX_TOKENS_PER_TILE:
        raise NotImplementedError(f"tokens_per_tile {N}: a multiple of 8 in [8, {MAX_TOKENS_PER_TILE}]")
    for what, b in zip(("gate/up", "down"), smem_bytes(launch, I, L, a_in_smem), strict=True):
        if b > SMEM_BYTES:
            raise NotImplementedError(f"{what} kernel: {launch} needs {b} bytes of SMEM (> {SMEM_BYTES})")


# ------------------------------------------------------------------------------------------------ the kernels
def _bcast(row, cols):
    """A per-row value [64] -> [64, cols] in the WGMMA layout (layout_cast tells the lowering which)."""
    return plgpu.layout_cast(lax.broadcast_in_dim(row, (ROWS, cols), (0,)), plgpu.Layout.WGMMA)


def _mma_tile(acc_ref, codes_smem, scale_rows, xe_smem, xo_smem, a_smem):
    """acc [64, N] += W_tile @ x_tile for one K step: codes [64, Kb] uint8 (the lo / hi nibbles: Kb even / odd
    elements), scale_rows: the step's Kb / 16 per-group E8M0 rows ([64] each, row layout), xe / xo [N, Kb] bf16
    (x's even / odd elements). Decoded in chunks of WGMMA's swizzle width; a_smem: None (A from registers) or
    the two [64, chunk] SMEM tiles A goes through (interpret mode)."""
    Kb = codes_smem.shape[1]
    chunk = _swizzle(Kb) // 2
    groups = chunk // GROUP_BYTES
    for c in range(Kb // chunk):
        cols = pl.ds(c * chunk, chunk)
        terms = [mxfp4.e2m1_scale_terms(scale_rows[c * groups + g]) for g in range(groups)]
        exp_term = jnp.concatenate([_bcast(t, GROUP_BYTES) for t, _ in terms], axis=1)
        mag_mask = jnp.concatenate([_bcast(m, GROUP_BYTES) for _, m in terms], axis=1)
        codes = plgpu.load(codes_smem.at[:, cols], layout=plgpu.Layout.WGMMA, optimized=False).astype(U16)
        lo = mxfp4.e2m1_bf16(codes & 0x0F, exp_term, mag_mask)
        hi = mxfp4.e2m1_bf16(codes >> 4, exp_term, mag_mask)
        xe, xo = xe_smem.at[:, cols].transpose((1, 0)), xo_smem.at[:, cols].transpose((1, 0))
        if a_smem is None:
            plgpu.wgmma(acc_ref, lo, xe)
            plgpu.wgmma(acc_ref, hi, xo)
        else:
            a_smem[0][...] = lo
            a_smem[1][...] = hi
            plgpu.commit_smem()  # the async proxy (WGMMA) reads what the threads wrote
            plgpu.wgmma(acc_ref, a_smem[0], xe)
            plgpu.wgmma(acc_ref, a_smem[1], xo)
        plgpu.wgmma_wait(0)  # the A chunk (registers or SMEM) is rewritten next


def _load_row(ref):
    return plgpu.load(ref, layout=ROW_LAYOUT, optimized=False)


def _store_columns(acc_F32, out_smem, out_row, *, tile_first, count, n_tokens):
    """The [64, N] fp32 tile's column t (token t of the tile) -> out_row(t) [64] for the tokens the group has:
    through SMEM, each column read back in the row layout (a value per row) and stored as one output row."""
    out_smem[...] = acc_F32
    plgpu.commit_smem()  # a warpgroup barrier: each column is read by other threads than wrote it

    for t in range(n_tokens):

        @pl.when(tile_first + t < count)
        def _(t=t):  # traced here and now: the default only tells the linter so
            dst = out_row(t)
            dst[...] = _load_row(out_smem.at[:, t]).astype(dst.dtype)


def _up_body(slots_ref, w1c, w3c, w1s, w3s, x2_ref, h_ref, out_smem, *a_smem, n_tokens, steps, beta):
    """Grid (slot, parity p, row block b). w1c / w3c [E, I/2, 2, L/2] uint8, w1s / w3s [E, I/2, 2, L/32],
    x2 [2, P, L/2] bf16 (z's even / odd columns in pair order) -> h [2, P, I2p]: h[p, pair, 64b + r] for the
    slot's pairs, rows past I/2 (the TMA's zero fill) land in I2p's padding."""
    s, p, b = lax.axis_index("s"), lax.axis_index("p"), lax.axis_index("b")
    e, start, count = slots_ref[0, s], slots_ref[1, s], slots_ref[2, s]
    n_k = w1c.shape[-1] // UP_BLOCK
    sw = _swizzle(UP_BLOCK)
    a_smem = a_smem or None

    @pl.when(count > 0)
    def _():
        @pl.loop(0, pl.cdiv(count, n_tokens))
        def _(tile):
            row0 = start + tile * n_tokens

            def scope(acc1, acc3):
                def step(_, c1, c3, s1, s3, xe, xo):
                    for acc, codes, scales in ((acc1, c1, s1), (acc3, c3, s3)):
                        rows = [_load_row(scales.at[:, g]) for g in range(UP_BLOCK // GROUP_BYTES)]
                        _mma_tile(acc, codes, rows, xe, xo, a_smem)

                w_spec = plgpu.BlockSpec((ROWS, UP_BLOCK), lambda k: (b, k))
                s_spec = plgpu.BlockSpec((ROWS, UP_BLOCK // GROUP_BYTES), lambda k: (b, k))
                x_spec = plgpu.BlockSpec((pl.Element(n_tokens), UP_BLOCK), lambda k: (row0, k), transforms=_tiled(sw))
                plgpu.emit_pipeline(
                    step,
                    grid=(n_k,),
                    max_concurrent_steps=min(steps, n_k),
                    in_specs=[w_spec, w_spec, s_spec, s_spec, x_spec, x_spec],
                )(w1c.at[e, :, p], w3c.at[e, :, p], w1s.at[e, :, p], w3s.at[e, :, p], x2_ref.at[0], x2_ref.at[1])
                return acc1[...], acc3[...]

            acc = plgpu.ACC((ROWS, n_tokens), F32)
            g, u = pl.run_scoped(scope, acc, acc)
            store = functools.partial(_store_columns, tile_first=tile * n_tokens, count=count, n_tokens=n_tokens)
            cols = pl.ds(b * ROWS, ROWS)
            if beta is None:  # the GEMMs' fp32 sums themselves (tests): h_ref [2 (gate, up), 2, P, I2p] fp32
                store(g, out_smem, lambda t: h_ref.at[0, p, row0 + t, cols])
                store(u, out_smem, lambda t: h_ref.at[1, p, row0 + t, cols])
            else:
                h = common.situ_glu(g.astype(BF16), u.astype(BF16), *beta)  # the spec's two roundings, then one
                store(h.astype(F32), out_smem, lambda t: h_ref.at[p, row0 + t, cols])


def _down_body(slots_ref, w2c, w2s, h_ref, y_ref, out_smem, *a_smem, n_tokens, steps, block):
    """Grid (slot, 64-row block r of L). w2c [E, L, I/2] uint8, w2s [E, L, I/32], h [2, P, I2p] bf16 ->
    y [P, L]: y[pair, 64r : 64r + 64] for the slot's pairs."""
    s, r = lax.axis_index("s"), lax.axis_index("r")
    e, start, count = slots_ref[0, s], slots_ref[1, s], slots_ref[2, s]
    n_k = w2c.shape[-1] // block
    rows = pl.ds(r * ROWS, ROWS)
    groups = block // GROUP_BYTES
    a_smem = a_smem or None

    @pl.when(count > 0)
    def _():
        @pl.loop(0, pl.cdiv(count, n_tokens))
        def _(tile):
            row0 = start + tile * n_tokens

            def scope(acc):
                def step(idx, codes, he, ho):
                    # ld.global of the step's scale rows, all issued before the first decode needs one
                    srows = [_load_row(w2s.at[e, rows, idx[0] * groups + g]) for g in range(groups)]
                    _mma_tile(acc, codes, srows, he, ho, a_smem)

                w_spec = plgpu.BlockSpec((ROWS, block), lambda k: (r, k))
                x_spec = plgpu.BlockSpec(
                    (pl.Element(n_tokens), block), lambda k: (row0, k), transforms=_tiled(_swizzle(block))
                )
                plgpu.emit_pipeline(
                    step, grid=(n_k,), max_concurrent_steps=min(steps, n_k), in_specs=[w_spec, x_spec, x_spec]
                )(w2c.at[e], h_ref.at[0], h_ref.at[1])
                return acc[...]

            y = pl.run_scoped(scope, plgpu.ACC((ROWS, n_tokens), F32))
            if y_ref.dtype != F32:
                y = y.astype(y_ref.dtype).astype(F32)  # rounded once, before the SMEM pass
            _store_columns(
                y,
                out_smem,
                lambda t: y_ref.at[row0 + t, rows],
                tile_first=tile * n_tokens,
                count=count,
                n_tokens=n_tokens,
            )


def _a_scratch(k_elems):
    sw = _swizzle(k_elems)
    return [plgpu.SMEM((ROWS, sw // 2), BF16, transforms=_tiled(sw)) for _ in range(2)]


def gate_up(experts, slots_3S, x2_2PL, *, launch: Launch, beta, interpret=None, a_in_smem=False):
    """The gate/up kernel -> h [2, P, I2p] bf16 (h[p, pair, i] = SiTU-GLU of pair's row 2i + p); beta = None:
    the two GEMMs' fp32 sums instead, [2 (W1, W3), 2, P, I2p] (what a test checks to fp32 accuracy)."""
    E, I, L = _shapes(experts)
    S, P = slots_3S.shape[1], x2_2PL.shape[1]
    I2p = pl.cdiv(I // 2, ROWS) * ROWS
    par = lambda a: a.reshape(E, I // 2, 2, a.shape[-1])  # free: rows 2i + p  # noqa: E731
    N = launch.tokens_per_tile
    kernel = plgpu.kernel(
        functools.partial(_up_body, n_tokens=N, steps=launch.up_steps, beta=beta),
        out_type=jax.ShapeDtypeStruct((2, P, I2p), BF16) if beta else jax.ShapeDtypeStruct((2, 2, P, I2p), F32),
        scratch_types=[plgpu.SMEM((ROWS, N), F32)] + (_a_scratch(UP_BLOCK) if a_in_smem else []),
        grid=(S, 2, I2p // ROWS),
        grid_names=("s", "p", "b"),
        compiler_params=_LANE,
        interpret=interpret,
    )
    return kernel(
        slots_3S,
        par(experts["w1_codes"]),
        par(experts["w3_codes"]),
        par(experts["w1_scales"]),
        par(experts["w3_scales"]),
        x2_2PL,
    )


def down(experts, slots_3S, h_2PI, *, launch: Launch, out_dtype=BF16, interpret=None, a_in_smem=False):
    """The down kernel -> y [P, L] in pair order (out_dtype: bf16, the spec's rounding; fp32 for tests)."""
    E, I, L = _shapes(experts)
    S, P = slots_3S.shape[1], h_2PI.shape[1]
    block = _down_block(I // 2)
    N = launch.tokens_per_tile
    kernel = plgpu.kernel(
        functools.partial(_down_body, n_tokens=N, steps=launch.down_steps, block=block),
        out_type=jax.ShapeDtypeStruct((P, L), out_dtype),
        scratch_types=[plgpu.SMEM((ROWS, N), F32)] + (_a_scratch(block) if a_in_smem else []),
        grid=(S, L // ROWS),
        grid_names=("s", "r"),
        compiler_params=_LANE,
        interpret=interpret,
    )
    return kernel(slots_3S, experts["w2_codes"], experts["w2_scales"], h_2PI)


def pair_inputs(z_TL, groups: grouping.Groups):
    """z's even and odd columns gathered in the aligned pair order: [2, R, L/2] (the gate/up kernel's N side)."""
    T, L = z_TL.shape
    z_eo = z_TL.reshape(T, L // 2, 2).transpose(2, 0, 1)
    return z_eo[:, groups.token_R]


_STATIC = ("situ_beta", "situ_linear_beta", "launch", "interpret", "a_in_smem", "out_dtype")


@functools.partial(jax.jit, static_argnames=_STATIC)
def grouped(
    experts, z_TL, sel_Tk, *, situ_beta, situ_linear_beta, launch, interpret=None, a_in_smem=False, out_dtype=BF16
):
    """Grouping and both kernels -> (groups, h [2, P, I2p], y [P, L] in pair order): the pieces tests check."""
    E = experts["w1_codes"].shape[0]
    groups = grouping.group_by_expert(sel_Tk, E)
    x2 = pair_inputs(z_TL, groups)
    kw = dict(launch=launch, interpret=interpret, a_in_smem=a_in_smem)
    h = gate_up(experts, groups.slots_3S, x2, beta=(situ_beta, situ_linear_beta), **kw)
    y = down(experts, groups.slots_3S, h, out_dtype=out_dtype, **kw)
    return groups, h, y


def routed_experts(experts, z_TL, sel_Tk, w_Tk, *, situ_beta, situ_linear_beta, tuning, interpret=None, a_in_smem=None):
    """The api's kernel entry: y [T, L] in z's dtype, or NotImplementedError for what the kernels do not take.
    a_in_smem: A through SMEM (None: where interpret mode needs it)."""
    T, k = sel_Tk.shape
    launch = pick_launch(tuning, T)
    a_in_smem = interpret is not None if a_in_smem is None else a_in_smem
    check_supported(experts, z_TL, sel_Tk, launch, a_in_smem)
    groups, _, y = grouped(
        experts,
        z_TL,
        sel_Tk,
        situ_beta=situ_beta,
        situ_linear_beta=situ_linear_beta,
        launch=launch,
        interpret=interpret,
        a_in_smem=a_in_smem,
    )
    return reference.combine(grouping.ungroup(y, groups, T, k), w_Tk)
