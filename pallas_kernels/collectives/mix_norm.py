"""A layer boundary in one launch: all-reduce of a row-parallel partial, the AttnRes prefix update, the AttnRes
mix over the stored blocks, and the next RMSNorm (docs/model.md §2.1-2.3). Pallas Mosaic GPU, no multicast.

Per token (one CTA each, the token's D features as a (D/128, 128) tile; the partials move by plain loads and
stores, the stored blocks, prefix and weights are staged in SMEM by TMA while they do):

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
# What a trace calls the launch (CUPTI: the name + "_mosaic_gpu_kernel"; unnamed it would be the body's, "body",
# which other kernels share). With AttnRes it is a layer boundary, a sublayer's end; without stored blocks (the
# latent MoE's routed_expert_norm) it sits inside a sublayer: bench/rank_slice.py's layer segmenting tells them
# apart by these names.
BOUNDARY_KERNEL = "mix_norm_attnres"
NORM_KERNEL = "mix_norm_rmsnorm"


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


def smem_bytes(Q, C, N, has_prefix, itemsize, q_itemsize=2):
    """What one CTA stages in SMEM: the N stored blocks and the prefix (x's dtype), w (x's dtype), and with
    blocks q's two factors (their dtype)."""
    q_bytes = Q * C * 2 * q_itemsize if N else 0
    return (N + has_prefix + 1) * Q * C * itemsize + q_bytes


def mix_norm(
    x_BQC,
    prefix_BQC,
    blocks,
    q_factors,
    w_QC,
    eps,
    *,
    axis_name,
    n,
    interpret=None,
    profile_dir="",
    online=None,
):
    """(P', normed) per token, both [B, Q, C] in x's dtype. prefix_BQC may be None; blocks: the N stored blocks,
    a sequence of [B, Q, C] arrays (each its own operand, so the caller's list needs no stacked copy), may be
    empty; q_factors: (res_norm [Q, C], res_proj [Q, C]) in one dtype, whose fp32 product is q (unused, and may
    be None, without blocks); w_QC in x's dtype.

    The token's stored blocks, prefix, q's factors and w are TMA-loaded into SMEM at the start, so their latency
    hides behind the exchange's round trip and AttnRes reads them from SMEM (q formed in registers where a score
    needs it: bf16 x bf16 is exact in fp32, the same bits as XLA's product).
    online: AttnRes as one pass with an online softmax (_attnres_online) instead of two unrolled passes; by
    default from more than one block (two-pass is faster at one block, level at four, far slower at eight:
    bench/results/mix_norm_profile.json).
    profile_dir: write Mosaic GPU's in-kernel trace of the named phases there (bench/mix_norm_profile.py)."""
    B, Q, C = x_BQC.shape
    dtype = x_BQC.dtype
    blocks = tuple(blocks or ())
    has_prefix, N = prefix_BQC is not None, len(blocks)
    online = N > 1 if online is None else online
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
            load_q = lambda: qf_smem[0].astype(F32) * qf_smem[1].astype(F32)  # noqa: E731
            h = (_attnres_online if online else _attnres)(new, blocks_smem, load_q, N, eps, dtype)
        with jax.named_scope("norm"):
            normed = (h * lax.rsqrt(_mean_sq(h) + eps)).astype(dtype).astype(F32) * w_smem[...].astype(F32)
            normed_gmem[b] = normed.astype(dtype)

    out_type = [jax.ShapeDtypeStruct((B, Q, C), dtype)] * 2
    scratch = [plgpu.SemaphoreType.REGULAR] if exchange else []
    if exchange:
        out_type.append(jax.ShapeDtypeStruct((n, B, Q, C), dtype))
    q_factors = tuple(q_factors) if N else ()
    scratch += [plgpu.SMEM((Q, C), dtype), plgpu.Barrier(num_arrivals=1 + 2 * bool(N) + has_prefix + N)]
    scratch += [plgpu.SMEM((Q, C), dtype)] if has_prefix else []
    if N:  # q's two factors, the stored blocks
        scratch += [plgpu.SMEM((2, Q, C), q_factors[0].dtype), plgpu.SMEM((N, Q, C), dtype)]
    operands = [x_BQC] + ([prefix_BQC] if has_prefix else []) + list(blocks) + list(q_factors)
    outs = plgpu.kernel(
        body,
        out_type=tuple(out_type),
        scratch_types=scratch,
        grid=(B,),
        grid_names=("tokens",),
        kernel_name=BOUNDARY_KERNEL if N else NORM_KERNEL,
        compiler_params=plgpu.CompilerParams(profile_space=256 if profile_dir else 0, profile_dir=profile_dir),
        interpret=interpret,
    )(*operands, w_QC.astype(dtype))
    return outs[0], outs[1]
