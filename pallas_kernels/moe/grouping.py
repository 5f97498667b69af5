"""Tokens grouped by expert on the device, in XLA (no host sync): what a grouped-experts kernel walks.

The T x k (token, expert) pairs are sorted by expert (stable, so a group keeps token order); the experts that
at least one token chose become the first `n_active` of `slots` static slots (ascending expert id), each with
its group's offset into the sorted pairs and its size; the slots past them have size 0 and their CTAs exit.
`slots` = min(E, T x k) is enough: there are never more distinct experts than pairs.
"""

import dataclasses

import jax
import jax.numpy as jnp

I32 = jnp.int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Groups:
    order_P: jax.Array  # int32 [P]: sorted position -> flat pair index t * k + j
    token_P: jax.Array  # int32 [P]: sorted position -> token
    slots_3S: jax.Array  # int32 [3, S]: per slot (expert id, first sorted position, group size; 0 = idle)


def num_slots(T: int, k: int, E: int) -> int:
    return min(E, T * k)


def group_by_expert(sel_Tk, num_experts: int) -> Groups:
    T, k = sel_Tk.shape
    S = num_slots(T, k, num_experts)
    flat = sel_Tk.reshape(-1).astype(I32)
    order = jnp.argsort(flat, stable=True).astype(I32)
    counts = jnp.zeros((num_experts,), I32).at[flat].add(1)
    starts = jnp.cumsum(counts) - counts  # exclusive: the first sorted position of each expert's group
    (active,) = jnp.nonzero(counts > 0, size=S, fill_value=0)
    active = active.astype(I32)
    used = jnp.arange(S, dtype=I32) < jnp.sum(counts > 0)
    slots = jnp.stack([active, starts[active], jnp.where(used, counts[active], 0)])
    return Groups(order_P=order, token_P=order // k, slots_3S=slots)


def ungroup(y_PL, groups: Groups, T: int, k: int):
    """Rows in sorted order [P, ...] -> [T, k, ...] in (token, choice) order."""
    P = T * k
    inverse = jnp.zeros((P,), I32).at[groups.order_P].set(jnp.arange(P, dtype=I32))
    return y_PL[inverse].reshape(T, k, *y_PL.shape[1:])
