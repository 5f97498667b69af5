"""Tokens grouped by expert on the device, in XLA (no host sync): what a grouped-experts kernel walks.

The T x k (token, expert) pairs are sorted by expert (stable, so a group keeps token order); the experts that
at least one token chose become the first `n_active` of `slots` static slots (ascending expert id), each with
its group's first row and its size; the slots past them have size 0 and their CTAs exit. `slots` =
min(E, T x k) is enough: there are never more distinct experts than pairs.

Each group starts on a multiple of ALIGN rows of the kernels' pair-ordered arrays (rows between groups are
padding): the kernels' token tiles are TMA boxes of an (8, 64)-tiled SMEM layout, and a box that starts off
an 8-row boundary loaded zeros past the first tile boundary on the H200 (every pair of rank >= 1 at a multiple
of 8 came out 0: bench/results/moe_layer.md's first run), so tiles start aligned ("aligned group tables").
"""

import dataclasses

import jax
import jax.numpy as jnp

I32 = jnp.int32
ALIGN = 8  # rows: a group's first row in the kernels' pair order is a multiple of this


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Groups:
    order_P: jax.Array  # int32 [P]: sorted position -> flat pair index t * k + j
    row_P: jax.Array  # int32 [P]: sorted position -> its row in the kernels' (aligned) pair order
    token_R: jax.Array  # int32 [R]: row -> token (padding rows: token 0, never stored)
    slots_3S: jax.Array  # int32 [3, S]: per slot (expert id, first row, group size; 0 = idle)


def num_slots(T: int, k: int, E: int) -> int:
    return min(E, T * k)


def num_rows(T: int, k: int, E: int) -> int:
    """Rows of the aligned pair order: every group rounded up to ALIGN, at most ALIGN - 1 padding rows each."""
    return T * k + (ALIGN - 1) * num_slots(T, k, E)


def group_by_expert(sel_Tk, num_experts: int) -> Groups:
    T, k = sel_Tk.shape
    S = num_slots(T, k, num_experts)
    flat = sel_Tk.reshape(-1).astype(I32)
    order = jnp.argsort(flat, stable=True).astype(I32)
    counts = jnp.zeros((num_experts,), I32).at[flat].add(1)
    starts = jnp.cumsum(counts) - counts  # exclusive: the first sorted position of each expert's group
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    first_row = jnp.cumsum(padded) - padded  # each group's first row, a multiple of ALIGN
    e_sorted = flat[order]
    row = (first_row[e_sorted] + jnp.arange(T * k, dtype=I32) - starts[e_sorted]).astype(I32)
    token = jnp.zeros((num_rows(T, k, num_experts),), I32).at[row].set(order // k)
    # the chosen experts in ascending order: a prefix count gives each its slot (a scatter, not nonzero's
    # compare-and-reduce over slots x experts: 23 us on the H200 at every T >= 4)
    chosen = counts > 0
    slot_of = jnp.cumsum(chosen, dtype=I32) - 1
    idx = jnp.where(chosen, slot_of, S)  # experts nobody chose: dropped
    active = jnp.zeros((S,), I32).at[idx].set(jnp.arange(num_experts, dtype=I32), mode="drop")
    used = jnp.arange(S, dtype=I32) <= slot_of[-1]
    slots = jnp.stack([active, first_row[active], jnp.where(used, counts[active], 0)])
    return Groups(order_P=order, row_P=row, token_R=token, slots_3S=slots)


def ungroup(y_RL, groups: Groups, T: int, k: int):
    """Rows in the kernels' aligned pair order [R, ...] -> [T, k, ...] in (token, choice) order."""
    P = T * k
    row_of_pair = jnp.zeros((P,), I32).at[groups.order_P].set(groups.row_P)
    return y_RL[row_of_pair].reshape(T, k, *y_RL.shape[1:])
