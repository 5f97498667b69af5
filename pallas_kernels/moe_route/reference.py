"""XLA reference of the routing step (docs/model.md §6, after the sigmoid): what the model ran before the kernel,
and the fallback.

route: lax.top_k over the biased scores picks the experts (ties to the lower index), the weights are the
UNBIASED scores there, renormalised (+1e-20) where asked and k > 1, then times the scaling factor, in fp32.
"""

import jax
import jax.numpy as jnp


def route(scores_TE, biased_TE, *, k, renormalize=True, scaling=1.0):
    """-> (sel [T, k] int32, w [T, k] fp32); sel in top_k's order (largest biased score first)."""
    _, sel = jax.lax.top_k(biased_TE, k)
    w = jnp.take_along_axis(scores_TE, sel, axis=-1)
    if renormalize and k > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return sel.astype(jnp.int32), w * scaling


def split_block(block_TX, ranks: int, e_local: int):
    """The ranks' all-gathered routing block [T, ranks x W] -> (scores [T, E], biased [T, E]), E = ranks x E_l:
    each rank's W-wide piece starts with its E_l scores, then its E_l biased scores (expert r E_l + j at piece
    r's j; the rest of the piece is not routing's)."""
    pieces = block_TX.reshape(block_TX.shape[0], ranks, -1)
    return tuple(pieces[..., i * e_local : (i + 1) * e_local].reshape(block_TX.shape[0], -1) for i in (0, 1))
