"""Two XLA forms of group_by_expert that avoid the reference's argsort (a two-operand sort), its scatter-add
and nonzero (a cumsum and a scatter); both give exactly reference.group_by_expert's ExpertGroups.

The grouping stays in XLA, not in the routing kernel: the stable pair order needs a scatter (or a scan plus
per-thread dynamic-address stores) and the offsets a prefix sum over every token's counts, i.e. a grid-wide
dependency. Pallas Mosaic GPU in jax 0.11.2 stores whole register arrays through static layouts (no scatter,
no per-thread addresses short of inline MLIR, which interpret mode cannot run), lowers no cumsum, and has no
grid-wide barrier a CPU test could run (semaphores are not interpreted).

"keys": one single-operand sort of the unique int32 keys expert * P + p (no stability needed, no payload),
  then compare-sums: offsets_E1[e] = #{p : e_p < e}, and the compaction of the active experts as a rank
  compare over [E, E].
"rank": no sort at all: a pair's position is the number of keys below its key ([P, P] compare-sum), the
  inverse permutation another [P, P] compare-sum. O(P^2), so for small P (P = 16 at T = 1, 1024 at T = 64).
Which is cheaper on the H200 at which T is what bench/moe_route.py --groups measures.
"""

import jax.numpy as jnp

from pallas_kernels.moe_route.reference import ExpertGroups

I32 = jnp.int32


def _below(a_N, b_M):
    """[M]: for each b, how many entries of a are < b (a fused compare-sum, no sort)."""
    return jnp.sum(a_N[None, :] < b_M[:, None], axis=1, dtype=I32)


def _offsets_and_experts(e_P, E):
    offsets = _below(e_P, jnp.arange(E + 1, dtype=I32))
    counts = offsets[1:] - offsets[:-1]
    active = counts > 0
    n = jnp.sum(active, dtype=I32)
    slot_E = _below(jnp.where(active, jnp.arange(E, dtype=I32), E), jnp.arange(E, dtype=I32))  # actives below e
    i_E = jnp.arange(E, dtype=I32)
    # experts[i] = the active e whose slot is i: a one-hot sum, no scatter
    hit = active[None, :] & (slot_E[None, :] == i_E[:, None])
    experts = jnp.sum(jnp.where(hit, i_E[None, :], 0), axis=1, dtype=I32)
    return counts, offsets, jnp.where(i_E < n, experts, E), n


def group_by_keys(sel_Tk, num_experts):
    E = num_experts
    e_P = sel_Tk.reshape(-1).astype(I32)
    P = e_P.shape[0]
    keys = jnp.sort(e_P * P + jnp.arange(P, dtype=I32))  # unique, so any sort is the stable order
    counts, offsets, experts, n = _offsets_and_experts(e_P, E)
    return ExpertGroups(counts, offsets, keys % P, experts, n)


def group_by_rank(sel_Tk, num_experts):
    E = num_experts
    e_P = sel_Tk.reshape(-1).astype(I32)
    P = e_P.shape[0]
    p_P = jnp.arange(P, dtype=I32)
    keys = e_P * P + p_P
    pos = _below(keys, keys)  # where pair p lands
    pairs = jnp.sum(jnp.where(pos[None, :] == p_P[:, None], p_P[None, :], 0), axis=1, dtype=I32)
    counts, offsets, experts, n = _offsets_and_experts(e_P, E)
    return ExpertGroups(counts, offsets, pairs, experts, n)
