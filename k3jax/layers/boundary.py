"""Where a sublayer's output joins the residual stream (docs/model.md §2.3), and the all-reduce that precedes it.

Every row-parallel sublayer (KDA/MLA o_proj, dense FFN down, MoE latent_up + shared experts) returns this rank's
partial sum. `join` all-reduces it, adds it to the running prefix P, mixes the stored blocks and P with AttnRes
and applies the next RMSNorm: what the next sublayer reads. With a decode policy asking for kernels
(Comm.fuses_boundaries) that is one Pallas launch (pallas_kernels.collectives.mix_norm) instead of an all-reduce
and 3-4 XLA kernels: under tp always, unsharded (TP1, bench/rank_slice.py's stub) the kernel without its
exchange where the collectives tuning's mix_norm_single_device allows it. Otherwise (and when AttnRes weights
are recorded) it is the all-reduce of `Comm` and the same maths in XLA
(pallas_kernels.collectives.reference.mix_norm, also the kernel's fallback and oracle).
"""

from k3jax.comm import Comm
from pallas_kernels.collectives import reference


def join(comm: Comm, part, norm_w, eps, what: str, prefix=None, blocks=(), mix=None, record=None, key=None):
    """-> (P', normed): P' = allreduce(part) (+ prefix; None at a block boundary), h = AttnRes(blocks + [P'];
    mix = {"norm", "proj"}) or P' when there are no blocks, normed = rms_norm(h, norm_w). record[key] gets the
    AttnRes weights [N, ...] when record is a dict (notebooks; XLA path)."""
    res_norm, res_proj = (mix["norm"], mix["proj"]) if blocks else (None, None)
    # Unsharded, the api's fallback is exactly the XLA path below (mix_norm of the partial itself), so it is taken
    # under any policy: the boundary is then in the dispatch log under auto too, as every other decode op is.
    if (comm.fuses_boundaries or not comm.sharded) and record is None:
        from pallas_kernels.collectives import api

        comm.note_fused(what, part)  # counted where an all-reduce happens (StubComm: logged for the projection)
        return api.all_reduce_mix_norm(
            part, prefix, blocks, res_norm, res_proj, norm_w, eps, comm.exchange_axis, policy=comm.policy
        )
    a = comm.all_reduce(part, what)
    if record is None:
        return reference.mix_norm(a, prefix, blocks, res_norm, res_proj, norm_w, eps)
    new, normed, alpha = reference.mix_norm(a, prefix, blocks, res_norm, res_proj, norm_w, eps, return_weights=True)
    if alpha is not None:  # the softmax weights over the sources [N, B, T]
        record[key] = alpha
    return new, normed
