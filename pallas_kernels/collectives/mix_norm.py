"""A layer boundary in one launch: all-reduce of a row-parallel partial, the AttnRes prefix update, the AttnRes
mix over the stored blocks, and the next RMSNorm (docs/model.md §2.1-2.3). Pallas Mosaic GPU, no multicast.

Per token (one CTA each, the token's D features as a (D/512, 4, 128) tile, tile_shape; the partials move by plain
loads and stores, the stored blocks, prefix and weights are staged in SMEM by TMA while they do):

    a      = round( sum_{r = 0..n-1} partial_r )                 FP32 sum in rank order, as the all-reduce
    P'     = a                 (at a block boundary: no prefix)
           = round(P + a)      (otherwise)
    h      = AttnRes(blocks + [P'])                              (h = P' when there are no blocks)
           = round( sum_i alpha_i v_i ),  alpha = softmax_i( rsqrt(mean(v_i^2) + eps) * (v_i . q) )
    normed = round( round(h * rsqrt(mean(h^2) + eps)) * w )      (HF RMSNorm order)

with q = res_norm.weight * res_proj.weight in FP32 (only their product enters), formed in the kernel from the two
weights (a product XLA would run as a kernel of its own before every boundary, ~1.3 us a launch at batch 1:
bench/results/rank_slice_boundary.md's loop_multiply_fusion_41). The kernel returns (P', normed):
P' is the running prefix the decoder carries on, normed feeds the next sublayer. Without a prefix and blocks it
is the all-reduce + RMSNorm of the latent MoE's routed_expert_norm.

Exchange: the plain-store one-shot of kernels.one_shot_st (each rank stores its row into slot `me` of every
peer's receive buffer, signals, waits for n-1 signals, sums the n slots in rank order: every rank gets the same
bits). n == 1 skips it (no semaphores), which is what interpret mode on CPU can run: the epilogue maths is
tested there, the exchange on GPUs.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.collectives.kernels import exchange_st

F32 = jnp.float32
LANES = 128  # the tile's last axis
GROUP = 4  # its middle axis where the lane rows allow: the batched AttnRes puts it on the warpgroup's 4 warps
ATTNRES = ("two_pass", "online", "batched")  # the forms of AttnRes (mix_norm's attnres)
# What a trace calls the launch (CUPTI: the name + "_mosaic_gpu_kernel"; unnamed it would be the body's, "body",
# which other kernels share). With AttnRes it is a layer boundary, a sublayer's end; without stored blocks (the
# latent MoE's routed_expert_norm) it sits inside a sublayer: bench/rank_slice.py's layer segmenting tells them
# apart by these names.
BOUNDARY_KERNEL = "mix_norm_attnres"
NORM_KERNEL = "mix_norm_rmsnorm"


def tile_shape(d: int) -> tuple[int, int, int]:
    """A token's d features as the kernel's tile (R, G, 128): (d / 512, 4, 128) where 4 divides the lane rows
    (the batched AttnRes's layout needs it), else (d / 128, 1, 128)."""
    rows = d // LANES
    group = GROUP if rows % GROUP == 0 else 1
    return rows // group, group, LANES


def _mean_sq(v):
    return jnp.sum(v * v) * (1.0 / v.size)


def _attnres(new, blocks_smem, load_q, N, eps, dtype):
    """round(sum_i alpha_i v_i) over the N stored blocks (SMEM) and new, in fp32; new itself without blocks."""
    if not N:
        return new.astype(F32)
    q = load_q()
    sources = [lambda i=i: blocks_smem[i].astype(F32) for i in range(N)] + [lambda: new.astype(F32)]
    scores = []
    for src in sources:
        v = src()
        scores.append(lax.rsqrt(_mean_sq(v) + eps) * jnp.sum(v * q))
    m = scores[0]
    for sc in scores[1:]:
        m = jnp.maximum(m, sc)
    e = [jnp.exp(sc - m) for sc in scores]
    z = e[0]
    for ei in e[1:]:
        z = z + ei
    h = e[0] / z * sources[0]()  # the second pass reads SMEM again rather than holding N rows in registers
    for ei, src in zip(e[1:], sources[1:], strict=True):
        h = h + ei / z * src()
    return h.astype(dtype).astype(F32)


def _attnres_online(new, blocks_smem, load_q, N, eps, dtype):
    """_attnres in one pass (online softmax): a loop over the stored blocks carries the running max score m,
    the softmax denominator z and the unnormalised mix h, each block read from SMEM once. The same sum up to
    fp32 rounding; a rolled loop keeps the code small and only h, v and q live (the unrolled two-pass form's
    time grows superlinearly with the blocks)."""
    v_new = new.astype(F32)
    if not N:
        return v_new

    def score(v):
        return lax.rsqrt(_mean_sq(v) + eps) * jnp.sum(v * load_q())

    def step(i, carry):
        m, z, h = carry
        v = blocks_smem[i].astype(F32)
        s = score(v)
        m_next = jnp.maximum(m, s)
        rescale, e = jnp.exp(m - m_next), jnp.exp(s - m_next)
        return m_next, z * rescale + e, h * rescale + e * v

    m, z, h = lax.fori_loop(0, N, step, (score(v_new), jnp.float32(1.0), v_new))
    return (h / z).astype(dtype).astype(F32)


def _attnres_batched(sources_smem, qf_smem, eps, dtype):
    """_attnres over the M sources staged in SMEM, sources_smem [M, R, 4, C] (the stored blocks, then P'; q's
    factors in qf_smem [2, R, 4, C]), the 2M full-tile sums of the scores (|v|^2 and v.q of each source) reduced
    across the warps at once. The other forms reduce each sum over the whole CTA on its own, a chain of warp
    shuffles and two warpgroup barriers each, one after another (~0.7 us a block: bench/results/
    mix_norm_profile.json). Here each source is read in a layout (cols) whose sum over R is in a thread's
    registers and over C in its warp's lanes (shuffles, no barrier), so its two sums come out as [4] values, one
    a warp; the M of them are stacked into [M, 4] (stacked) and summed over the warps in one reduction. Then the
    softmax in every thread, and the mix reads the sources again from SMEM. The scores do not depend on each
    other (only the softmax needs all of them), so nothing orders their loads and shuffles either. Measured
    (H100, bench/results/mix_norm_h100.md): ~0.64 us a block against online's ~0.86, two_pass's ~0.66 up to four
    blocks (and far more past five): the reductions were not most of a block's cost. So the tuning runs two_pass
    up to four blocks and this form from five."""
    M, R, G, C = sources_smem.shape
    cols = plgpu.Layout.TILED(plgpu.Tiling(((G, C), (C // 32,))), warp_dims=(-3,), lane_dims=(-2,), vector_dim=-1)
    stacked = plgpu.Layout.TILED(
        plgpu.Tiling(((M, G), (1,))), warp_dims=(-2,), lane_dims=(plgpu.Replicated(32),), vector_dim=-1
    )
    source = plgpu.broadcasted_iota(jnp.int32, (M, G), 0, layout=stacked)

    def total(per_warp):  # M values [G] (a warp's partial sums) -> [M], each summed over the warps
        out = None
        for i, part in enumerate(per_warp):
            row = plgpu.layout_cast(lax.broadcast_in_dim(part, (M, G), (1,)), stacked)
            out = row if out is None else jnp.where(source == i, row, out)
        return jnp.sum(out, axis=1)

    q = plgpu.load(qf_smem.at[0], layout=cols, optimized=False).astype(F32)
    q = q * plgpu.load(qf_smem.at[1], layout=cols, optimized=False).astype(F32)
    sq, dot = [], []
    for i in range(M):
        v = plgpu.load(sources_smem.at[i], layout=cols, optimized=False).astype(F32)
        sq.append(jnp.sum(jnp.sum(v * v, axis=0), axis=1))
        dot.append(jnp.sum(jnp.sum(v * q, axis=0), axis=1))
    score = lax.rsqrt(total(sq) * (1.0 / (R * G * C)) + eps) * total(dot)
    e = jnp.exp(score - jnp.max(score, axis=0))
    alpha = e / jnp.sum(e, axis=0)
    index = lax.broadcasted_iota(jnp.int32, (M,), 0)
    h = None
    for i in range(M):
        term = jnp.sum(jnp.where(index == i, alpha, 0.0), axis=0) * sources_smem[i].astype(F32)
        h = term if h is None else h + term
    return h.astype(dtype).astype(F32)


def pick_attnres(N: int, attnres, group: int) -> str:
    """The AttnRes form for N stored blocks. attnres (the collectives tuning's mix_norm_attnres): a form, or rules
    [{"max_blocks": M (absent: any), "form": ...}, ...] whose first with N <= M picks it; None: online from two
    blocks, two_pass at one. Batched needs the tile's group of 4 (tile_shape): online stands in for it."""
    if isinstance(attnres, (list, tuple)):
        attnres = next((r["form"] for r in attnres if N <= r.get("max_blocks", N)), None)
    if attnres is None:
        attnres = "online" if N > 1 else "two_pass"
    if attnres not in ATTNRES:
        raise ValueError(f"mix_norm attnres {attnres!r}: one of {ATTNRES}")
    return "online" if attnres == "batched" and group != GROUP else attnres


def reduction_scratch_bytes(N: int, attnres: str) -> int:
    """SMEM the kernel's cross-warp reductions use (Mosaic GPU's reduction scratch): the batched scores' N + 1
    rows at once (512 bytes each), else Pallas' default."""
    return max(2048, 512 * (N + 1)) if attnres == "batched" and N else 2048


def smem_bytes(Q, C, N, has_prefix, itemsize, q_itemsize=2, attnres=None):
    """What one CTA stages in SMEM: the N stored blocks and the prefix (x's dtype), w (x's dtype), with blocks
    q's two factors (their dtype); the batched AttnRes also P' beside the blocks, and its reduction scratch."""
    attnres = pick_attnres(N, attnres, GROUP if Q % GROUP == 0 else 1)
    batched = attnres == "batched" and N > 0
    q_bytes = Q * C * 2 * q_itemsize if N else 0
    return (N + batched + has_prefix + 1) * Q * C * itemsize + q_bytes + reduction_scratch_bytes(N, attnres)


def mix_norm(
    x_B,
    prefix_B,
    blocks,
    q_factors,
    w,
    eps,
    *,
    axis_name,
    n,
    interpret=None,
    profile_dir="",
    attnres=None,
):
    """(P', normed) per token, both shaped like x in its dtype. Every operand is a token's tile (tile_shape):
    x_B [B, R, G, C]; prefix_B likewise or None; blocks: the N stored blocks, a sequence of [B, R, G, C] arrays
    (each its own operand, so the caller's list needs no stacked copy), may be empty; q_factors: (res_norm,
    res_proj) [R, G, C] in one dtype, whose fp32 product is q (unused, and may be None, without blocks); w
    [R, G, C] in x's dtype.

    The token's stored blocks, prefix, q's factors and w are TMA-loaded into SMEM at the start, so their latency
    hides behind the exchange's round trip and AttnRes reads them from SMEM (q formed in registers where a score
    needs it: bf16 x bf16 is exact in fp32, the same bits as XLA's product).
    attnres: the form of AttnRes (pick_attnres): "two_pass" (two unrolled passes), "online" (one pass, an online
    softmax: _attnres_online) or "batched" (the scores' sums in one cross-warp reduction, P' staged in SMEM
    beside the blocks: _attnres_batched), or rules by the number of blocks (pick_attnres); None: online from two
    blocks.
    profile_dir: write Mosaic GPU's in-kernel trace of the named phases there."""
    B, *tile = x_B.shape
    dtype = x_B.dtype
    blocks = tuple(blocks or ())
    has_prefix, N = prefix_B is not None, len(blocks)
    attnres = pick_attnres(N, attnres, tile[-2])
    staged = N + (attnres == "batched")  # SMEM slots: the blocks, and for the batched form P' after them
    exchange = n > 1

    def body(*refs):
        refs = list(refs)
        x_gmem = refs.pop(0)
        prefix_gmem = refs.pop(0) if has_prefix else None
        blocks_gmem = [refs.pop(0) for _ in range(N)]
        qf_gmem = [refs.pop(0) for _ in range(2 if N else 0)]
        w_gmem, new_gmem, normed_gmem = refs[:3]
        refs = refs[3:]
        recv_gmem = refs.pop(0) if exchange else None
        sem = refs.pop(0) if exchange else None
        w_smem, bar = refs[:2]
        refs = refs[2:]
        prefix_smem = refs.pop(0) if has_prefix else None
        qf_smem = refs.pop(0) if N else None
        blocks_smem = refs.pop(0) if N else None
        b = lax.axis_index("tokens")

        # Everything the epilogue reads, in flight while the partials are exchanged (one barrier counts all).
        loads = [(w_gmem, w_smem)] + [(f, qf_smem.at[i]) for i, f in enumerate(qf_gmem)]
        loads += [(prefix_gmem.at[b], prefix_smem)] if has_prefix else []
        loads += [(blk.at[b], blocks_smem.at[i]) for i, blk in enumerate(blocks_gmem)]
        for src, dst in loads:
            plgpu.copy_gmem_to_smem(src, dst, bar)

        with jax.named_scope("exchange"):
            if exchange:
                s = exchange_st(x_gmem.at[b], recv_gmem, (b,), axis_name, n, sem)
            else:
                s = x_gmem[b].astype(F32)
            a = s.astype(dtype)  # what the all-reduce hands back
        with jax.named_scope("wait_loads"):
            plgpu.barrier_wait(bar)
        with jax.named_scope("prefix"):
            new = (prefix_smem[...].astype(F32) + a.astype(F32)).astype(dtype) if has_prefix else a
            new_gmem[b] = new
        with jax.named_scope("attnres"):
            if attnres == "batched" and N:
                blocks_smem[N] = new  # P' is the last source; every thread reads other threads' part of it
                plgpu.commit_smem()
                h = _attnres_batched(blocks_smem, qf_smem, eps, dtype)
            else:
                load_q = lambda: qf_smem[0].astype(F32) * qf_smem[1].astype(F32)  # noqa: E731
                form = _attnres_online if attnres == "online" else _attnres
                h = form(new, blocks_smem, load_q, N, eps, dtype)
        with jax.named_scope("norm"):
            normed = (h * lax.rsqrt(_mean_sq(h) + eps)).astype(dtype).astype(F32) * w_smem[...].astype(F32)
            normed_gmem[b] = normed.astype(dtype)

    out_type = [jax.ShapeDtypeStruct(x_B.shape, dtype)] * 2
    scratch = [plgpu.SemaphoreType.REGULAR] if exchange else []
    if exchange:
        out_type.append(jax.ShapeDtypeStruct((n, *x_B.shape), dtype))
    q_factors = tuple(q_factors) if N else ()
    scratch += [plgpu.SMEM(tuple(tile), dtype), plgpu.Barrier(num_arrivals=1 + 2 * bool(N) + has_prefix + N)]
    scratch += [plgpu.SMEM(tuple(tile), dtype)] if has_prefix else []
    if N:  # q's two factors, the stored blocks (and P')
        scratch += [plgpu.SMEM((2, *tile), q_factors[0].dtype), plgpu.SMEM((staged, *tile), dtype)]
    operands = [x_B] + ([prefix_B] if has_prefix else []) + list(blocks) + list(q_factors)
    params = plgpu.CompilerParams(
        profile_space=256 if profile_dir else 0,
        profile_dir=profile_dir,
        reduction_scratch_bytes=reduction_scratch_bytes(N, attnres),
    )
    outs = plgpu.kernel(
        body,
        out_type=tuple(out_type),
        scratch_types=scratch,
        grid=(B,),
        grid_names=("tokens",),
        kernel_name=BOUNDARY_KERNEL if N else NORM_KERNEL,
        compiler_params=params,
        interpret=interpret,
    )(*operands, w.astype(dtype))
    return outs[0], outs[1]
