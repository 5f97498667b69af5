"""Row-parallel projection fused with the all-reduce that follows it: one Pallas Mosaic GPU kernel (sm90).

Inside `jax.shard_map` over `axis_name` (n ranks) every rank holds its K rows of the projection: x_BK (its
slice of the activation) and w_KD (its rows of the weight). The result, identical on every rank, is

    out_BD = round( residual_BD + sum_{r = 0..n-1} (x_BK @ w_KD)_r )      (FP32 until the final rounding)

Grid: one CTA per column tile of tile_d features. A CTA streams its [K, tile_d] weight slab through a TMA
pipeline into WGMMA (tokens on M: B is padded to one 64-row tile, and the padding costs no bytes because TMA
fills the rows past B with zeros instead of reading them), then exchanges only the B real rows of its FP32
partial: a TMA store into slot `me` of every peer's receive buffer `recv` (a kernel output, so XLA exchanges
its address), a wait until the stores landed, a signal of that tile's semaphore on each peer, a wait for n-1
signals on its own, TMA loads of the peers' slots, the sum of the n slots in rank order 0..n-1 in FP32 (so
every rank gets the same bits), the residual add, and one store. Tiles are sent as they are produced: a
CTA's reduction starts as soon as its own column tile is done, while other CTAs are still streaming weights.

Protocol and back-to-back safety are those of kernels.py (one-shot push, one block-local semaphore per CTA,
each signalled exactly n-1 times per call; receive buffers and semaphores are per-call XLA buffers, so the
XLA device barrier before the call stays on: see kernels.py and bench/NOTES.md, "Collectives"). CTA j waits
only for CTA j of the peers, so the grid is kept within one wave (every CTA resident) and no CTA can wait on
a peer CTA that is not scheduled.

RMSNorm of the result is not fused: a token's mean of squares needs all D features, i.e. every CTA's tile,
and that is a grid-wide synchronisation (all CTAs exchange per-row partial sums of squares and wait for each
other) on top of the cross-GPU one. Use `api.all_reduce_add_rmsnorm` / XLA after this kernel, or grow this
kernel a global-semaphore grid barrier (possible: the grid is one resident wave) if the norm's launch shows
up in the profile.

Status: right on 2 H200s at every real and random shape and in back-to-back stress steps; opt-in
(DecodePolicy(fused_projection=True)) because it is slower than XLA's dot + psum at most decode shapes
(bench/results/fused_projection.md).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

M_PAD = 64  # WGMMA's M: tokens are the M side, padded to one 64-row tile
TILE_D = 64  # features per CTA: D = 7168 gives 112 CTAs (one wave on 132 SMs)
MAX_STAGES = 8  # weight tiles in flight per CTA (8 KB each at tile_k = tile_d = 64)


def tile_k_for(K):
    """Contraction tile: 64 bf16 elements = one 128-byte swizzle row; 32 (64-byte swizzle) when K needs it."""
    return next((t for t in (64, 32) if K % t == 0), None)


def smem_bytes(K, n, tile_d=TILE_D, max_stages=MAX_STAGES, itemsize=2, res_itemsize=2):
    """SMEM one CTA allocates: the GEMM pipeline, the exchange scratch and the residual buffer, side by side.

    The exchange scratch sits beside the pipeline's buffers rather than reusing their bytes (sequential scopes
    could share them); the SMEM budget allows it."""
    tk = tile_k_for(K)
    stages = max(2, min(max_stages, K // tk))
    pipeline = stages * (M_PAD * tk + tk * tile_d) * itemsize
    exchange = n * M_PAD * tile_d * 4 + M_PAD * tile_d * max(itemsize, res_itemsize)
    return pipeline + exchange + M_PAD * tile_d * res_itemsize


def _partial_tile(x_gmem, w_gmem, tile_k, stages):
    """FP32 [M_PAD, tile_d] = x (rows past B read as zeros) @ this CTA's weight slab, in WGMMA layout."""
    K = x_gmem.shape[1]
    tile_d = w_gmem.shape[1]
    swizzle = plgpu.find_swizzle(tile_k * jnp.dtype(x_gmem.dtype).itemsize * 8)
    # x [M_PAD, tile_k] and w [tile_k, tile_d] share one swizzle (WGMMA requires it): tile_d is a multiple of
    # tile_k, so w's minor dim splits into whole swizzle rows.
    transforms = (
        plgpu.TilingTransform((8, swizzle // jnp.dtype(x_gmem.dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )

    def scoped(acc_ref):
        def step(_, x_smem, w_smem):
            plgpu.wgmma(acc_ref, x_smem, w_smem)
            plgpu.wgmma_wait(1)  # the previous step's WGMMA is done: its slot may be refilled (delay_release=1)

        plgpu.emit_pipeline(
            step,
            grid=(K // tile_k,),
            max_concurrent_steps=stages,
            in_specs=[
                plgpu.BlockSpec((M_PAD, tile_k), lambda k: (0, k), transforms=transforms, delay_release=1),
                plgpu.BlockSpec((tile_k, tile_d), lambda k: (k, 0), transforms=transforms, delay_release=1),
            ],
        )(x_gmem, w_gmem)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    return pl.run_scoped(scoped, plgpu.ACC((M_PAD, tile_d), jnp.float32))


def proj_all_reduce(
    x_BK,
    w_KD,
    residual_BD=None,
    *,
    axis_name,
    n,
    tile_d=TILE_D,
    max_stages=MAX_STAGES,
    interpret=None,
):
    """sum over the n ranks of `axis_name` of x_BK @ w_KD (+ residual_BD), same bits on every rank.

    Output dtype: residual_BD's if given, else x_BK's. n == 1 runs the same GEMM + epilogue without the
    exchange (no semaphores), which is what interpret mode on CPU can execute.
    """
    B, K = x_BK.shape
    K2, D = w_KD.shape
    tile_k = tile_k_for(K)
    if K2 != K or not 1 <= B <= M_PAD or tile_k is None or D % tile_d or tile_d % tile_k:
        raise NotImplementedError(f"proj_all_reduce: x{x_BK.shape} w{w_KD.shape} tile_d={tile_d}")
    if B > 8 and B % 8:  # a TMA box of B rows must be <= 8 rows or a multiple of 8: zero rows, sliced off
        pad = lambda a: None if a is None else jnp.pad(a, ((0, -B % 8), (0, 0)))  # noqa: E731
        return proj_all_reduce(
            pad(x_BK),
            w_KD,
            pad(residual_BD),
            axis_name=axis_name,
            n=n,
            tile_d=tile_d,
            max_stages=max_stages,
            interpret=interpret,
        )[:B]
    stages = max(2, min(max_stages, K // tile_k))
    has_res = residual_BD is not None
    out_dtype = residual_BD.dtype if has_res else x_BK.dtype
    exchange = n > 1

    def body(x_gmem, w_gmem, *refs):
        res_gmem, refs = (refs[0], refs[1:]) if has_res else (None, refs)
        out_gmem, recv_gmem, sem = refs if exchange else (refs[0], None, None)
        cols = pl.ds(lax.axis_index("tiles") * tile_d, tile_d)
        me = lax.axis_index(axis_name) if exchange else 0

        def scoped(part_nMT, out_MT, bars, res_MT=None, res_bar=None):
            if has_res:  # lands while the weights stream
                plgpu.copy_gmem_to_smem(res_gmem.at[:, cols], res_MT.at[pl.ds(0, B)], res_bar.at[0])
            acc = _partial_tile(x_gmem, w_gmem.at[:, cols], tile_k, stages)

            def epilogue():
                part_nMT.at[me][...] = acc
                if exchange:
                    peers = [{axis_name: lax.rem(me + k, n)} for k in range(1, n)]
                    plgpu.commit_smem()  # register stores -> visible to the TMA engine
                    for peer in peers:
                        plgpu.copy_smem_to_gmem(
                            part_nMT.at[me, pl.ds(0, B)], plgpu.remote_ref(recv_gmem, peer).at[me, :, cols]
                        )
                    plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # landed in the peers' memory
                    for peer in peers:
                        pl.semaphore_signal(sem, device_id=peer)
                    pl.semaphore_wait(sem, n - 1)
                    for r in range(n):

                        @pl.when(me != r)
                        def _load(r=r):  # pl.when runs the body at trace time; r is bound for the linter
                            plgpu.copy_gmem_to_smem(recv_gmem.at[r, :, cols], part_nMT.at[r, pl.ds(0, B)], bars.at[r])

                    for r in range(n):

                        @pl.when(me != r)
                        def _wait(r=r):
                            plgpu.barrier_wait(bars.at[r])

                # Rows past B hold zeros (mine) or stale SMEM (peers'); they are summed but never stored.
                total = part_nMT[0]
                for r in range(1, n):
                    total = total + part_nMT[r]
                if has_res:
                    plgpu.barrier_wait(res_bar.at[0])
                    total = total + res_MT[...].astype(jnp.float32)
                out_MT[...] = total.astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_MT.at[pl.ds(0, B)], out_gmem.at[:, cols])
                plgpu.wait_smem_to_gmem(0)

            epilogue()

        # Exchange scratch allocated beside (not over) the GEMM pipeline's buffers: see smem_bytes.
        scratch = [
            plgpu.SMEM((n, M_PAD, tile_d), jnp.float32),
            plgpu.SMEM((M_PAD, tile_d), out_dtype),
            plgpu.Barrier(num_barriers=n),
        ]
        if has_res:
            scratch += [plgpu.SMEM((M_PAD, tile_d), residual_BD.dtype), plgpu.Barrier(num_barriers=1)]
        pl.run_scoped(scoped, *scratch)

    out_type = [jax.ShapeDtypeStruct((B, D), out_dtype)]
    if exchange:
        out_type.append(jax.ShapeDtypeStruct((n, B, D), jnp.float32))
    outs = plgpu.kernel(
        body,
        out_type=tuple(out_type),
        scratch_types=[plgpu.SemaphoreType.REGULAR] if exchange else [],
        grid=(D // tile_d,),
        grid_names=("tiles",),
        interpret=interpret,
    )(x_BK, w_KD, *([residual_BD] if has_res else []))
    return outs[0]
