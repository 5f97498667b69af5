"""A layer boundary in one launch: all-reduce of a row-parallel partial, the AttnRes prefix update, the AttnRes
mix over the stored blocks, and the next RMSNorm (K3_SPEC §2.1-2.3). Pallas Mosaic GPU, no multicast.

Per token (one CTA each, the token's D features as a (D/128, 128) tile, plain loads and stores):

    a      = round( sum_{r = 0..n-1} partial_r )                 FP32 sum in rank order, as the all-reduce
    P'     = a                 (at a block boundary: no prefix)
           = round(P + a)      (otherwise)
    h      = AttnRes(blocks + [P'])                              (h = P' when there are no blocks)
           = round( sum_i alpha_i v_i ),  alpha = softmax_i( rsqrt(mean(v_i^2) + eps) * (v_i . q) )
    normed = round( round(h * rsqrt(mean(h^2) + eps)) * w )      (HF RMSNorm order)

with q = res_norm.weight * res_proj.weight in FP32 (only their product enters). The kernel returns (P', normed):
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


def _mean_sq(v):
  return jnp.sum(v * v) * (1.0 / v.size)


def mix_norm(x_BQC, prefix_BQC, blocks_NBQC, q_QC, w_QC, eps, *, axis_name, n, skip_barrier=False,
             interpret=None):
  """(P', normed) per token, both [B, Q, C] in x's dtype. prefix_BQC / blocks_NBQC may be None."""
  B, Q, C = x_BQC.shape
  dtype = x_BQC.dtype
  has_prefix, N = prefix_BQC is not None, 0 if blocks_NBQC is None else blocks_NBQC.shape[0]
  exchange = n > 1

  def body(*refs):
    refs = list(refs)
    x_gmem = refs.pop(0)
    prefix_gmem = refs.pop(0) if has_prefix else None
    blocks_gmem = refs.pop(0) if N else None
    q_gmem, w_gmem, new_gmem, normed_gmem = refs[:4]
    recv_gmem, sem = refs[4:] if exchange else (None, None)
    b = lax.axis_index("tokens")

    if exchange:
      s = exchange_st(x_gmem.at[b], recv_gmem, (b,), axis_name, n, sem)
    else:
      s = x_gmem[b].astype(F32)
    a = s.astype(dtype)  # what the all-reduce hands back
    new = (prefix_gmem[b].astype(F32) + a.astype(F32)).astype(dtype) if has_prefix else a
    new_gmem[b] = new

    if N:
      q = q_gmem[...]
      sources = [lambda i=i: blocks_gmem[i, b].astype(F32) for i in range(N)] + [lambda: new.astype(F32)]
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
      h = e[0] / z * sources[0]()  # the blocks are read again from L2 rather than held in registers
      for ei, src in zip(e[1:], sources[1:], strict=True):
        h = h + ei / z * src()
      h = h.astype(dtype).astype(F32)
    else:
      h = new.astype(F32)
    normed = (h * lax.rsqrt(_mean_sq(h) + eps)).astype(dtype).astype(F32) * w_gmem[...]
    normed_gmem[b] = normed.astype(dtype)

  out_type = [jax.ShapeDtypeStruct((B, Q, C), dtype)] * 2
  if exchange:
    out_type.append(jax.ShapeDtypeStruct((n, B, Q, C), dtype))
  operands = [x_BQC] + ([prefix_BQC] if has_prefix else []) + ([blocks_NBQC] if N else [])
  outs = plgpu.kernel(
      body,
      out_type=tuple(out_type),
      scratch_types=[plgpu.SemaphoreType.REGULAR] if exchange else [],
      grid=(B,), grid_names=("tokens",),
      compiler_params=plgpu.CompilerParams(skip_device_barrier=skip_barrier),
      interpret=interpret,
  )(*operands, q_QC.astype(F32), w_QC.astype(F32))
  return outs[0], outs[1]
