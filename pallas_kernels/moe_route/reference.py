"""XLA reference of the routing step (docs/model.md §6, after the sigmoid): what the model ran before the kernel,
and the fallback.

route: lax.top_k over the biased scores picks the experts (ties to the lower index), the weights are the
UNBIASED scores there, renormalised (+1e-20) where asked and k > 1, then times the scaling factor, in fp32.

group_by_expert: the T*k (token, slot) pairs sorted by expert with a stable argsort, per-expert counts and
offsets, and the experts anyone chose, compacted.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


def route(scores_TE, biased_TE, *, k, renormalize=True, scaling=1.0):
    """-> (sel [T, k] int32, w [T, k] fp32); sel in top_k's order (largest biased score first)."""
    _, sel = jax.lax.top_k(biased_TE, k)
    w = jnp.take_along_axis(scores_TE, sel, axis=-1)
    if renormalize and k > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return sel.astype(jnp.int32), w * scaling


class ExpertGroups(NamedTuple):
    """The (token, slot) pairs of a routing grouped by expert, all on device. P = T * k pairs; pair p is token
    p // k's slot p % k (sel_Tk.reshape(-1)[p] is its expert).

    counts_E:    int32 [E], pairs per expert.
    offsets_E1:  int32 [E + 1], exclusive prefix sums of counts_E: expert e's pairs are
                 pairs_P[offsets_E1[e] : offsets_E1[e + 1]]; offsets_E1[E] = P.
    pairs_P:     int32 [P], the pair ids sorted by expert, stable (ascending p, i.e. ascending token, within
                 an expert).
    experts_E:   int32 [E], the experts with count > 0 in ascending order, then E (padding).
    n_experts:   int32 [], how many entries of experts_E are experts.
    """

    counts_E: jax.Array
    offsets_E1: jax.Array
    pairs_P: jax.Array
    experts_E: jax.Array
    n_experts: jax.Array


def group_by_expert(sel_Tk, num_experts):
    """ExpertGroups of sel [T, k] by a stable argsort (the reference the faster forms are tested against)."""
    E = num_experts
    e_P = sel_Tk.reshape(-1).astype(jnp.int32)
    pairs = jnp.argsort(e_P, stable=True).astype(jnp.int32)
    counts = jnp.zeros(E, jnp.int32).at[e_P].add(1)
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    (experts,) = jnp.nonzero(counts > 0, size=E, fill_value=E)
    return ExpertGroups(counts, offsets, pairs, experts.astype(jnp.int32), jnp.sum(counts > 0, dtype=jnp.int32))
