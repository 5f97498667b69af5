"""Tokens grouped by expert on the device (no host sync): the slot table the grouped-experts kernels walk and the
rows their token tiles read.

Pair p = t k + j is token t's j-th choice, expert e_p. The groups keep token order and are laid out in an
aligned pair order of R rows: each group starts on a multiple of ALIGN (the kernels' token tiles are TMA boxes
of an (8, 64)-tiled SMEM layout, and a box that started off an 8-row boundary loaded zeros past the first tile
boundary on the H200: bench/results/moe_layer.md's first run; "aligned group tables"). In XLA, three
compare-sum fusions, no sort, cumsum or scatter (the sort-and-cumsum form took ~14 kernels, ~25 us, at every T):

1. before_p = #{q < p : e_q = e_p} (p's rank in its group), size_p = #{q : e_q = e_p};
2. over the pairs that lead their group (before = 0): slot_p = #{leading q : e_q < e_p} (the chosen experts in
   ascending order) and the group's first row, the sum of the ALIGN-rounded sizes of the groups below it;
   row_p = first row + before_p;
3. the slot table [3, S] (expert, first row, size), compacted from the leading pairs; S = min(E, T k) static
   slots, those past the chosen experts size 0 (their CTAs exit).

[P, P] compares (P = T k): 256 at T = 1, 1 M at T = 64, 67 M at T = 512, each one fused pass. One token
(T = 1) needs none of it: its k choices are k different experts (top-k), each its own group of one; a repeated
id would only make its expert's bytes read twice, never a wrong sum.

pair_rows then copies each token's row to its pairs' rows (a small TMA kernel, one CTA per token): only the
T k real rows are written, the padding rows between groups are left as they are (no kernel stores an output of
a padding row, and a WGMMA column does not mix with its neighbours), where a gather of all R rows wrote ~7x as
many bytes at T = 64 (R = T k + 7 x slots).
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

I32 = jnp.int32
ALIGN = 8  # rows: a group's first row in the kernels' pair order is a multiple of this
COPY_COLS = 128  # elements per row of a pair_rows TMA box (its dims are at most 256)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Groups:
    row_P: jax.Array  # int32 [P]: pair t k + j -> its row in the aligned pair order
    slots_3S: jax.Array  # int32 [3, S]: per slot (expert id, first row, group size; 0 = idle)


def num_slots(T: int, k: int, E: int) -> int:
    return min(E, T * k)


def num_rows(T: int, k: int, E: int) -> int:
    """Rows of the aligned pair order: every group rounded up to ALIGN, at most ALIGN - 1 padding rows each."""
    return T * k + (ALIGN - 1) * num_slots(T, k, E)


def _count(mask, values=None):
    """Row sums of a [M, P] mask (of values where given): one fused compare-sum pass."""
    return jnp.sum(mask if values is None else jnp.where(mask, values, 0), axis=1, dtype=I32)


def pair_slots(sel_Tk, align: int = ALIGN) -> Groups:
    """Every pair its own slot (expert, row align p, size 1): one token's table (its choices are different
    experts), and with align 1 the kernels' direct form at a few tokens (moe/bodies.is_direct)."""
    e = sel_Tk.reshape(-1).astype(I32)
    row = align * jnp.arange(e.shape[0], dtype=I32)
    return Groups(row_P=row, slots_3S=jnp.stack([e, row, jnp.ones_like(e)]))


def group_by_expert(sel_Tk, num_experts: int) -> Groups:
    T, k = sel_Tk.shape
    S = num_slots(T, k, num_experts)
    e = sel_Tk.reshape(-1).astype(I32)
    if T == 1 and k <= num_experts:
        return pair_slots(sel_Tk)
    p = jnp.arange(T * k, dtype=I32)
    same = e[:, None] == e[None, :]  # [p, q]
    before, size = _count(same & (p[None, :] < p[:, None])), _count(same)
    lead = before == 0
    below = lead[None, :] & (e[None, :] < e[:, None])  # [p, q]: q leads a group of a smaller expert
    padded = (size + ALIGN - 1) // ALIGN * ALIGN
    slot, first_row = _count(below), _count(below, padded[None, :])
    hit = lead[None, :] & (slot[None, :] == jnp.arange(S, dtype=I32)[:, None])  # [s, p]
    slots = jnp.stack([_count(hit, v[None, :]) for v in (e, first_row, size)])
    return Groups(row_P=first_row + before, slots_3S=slots)


def num_pieces(T: int, k: int, E: int, n_tokens: int) -> int:
    """Entries of split_groups' table: at most every group's ceil(size / n_tokens), sum(size) = T k."""
    P, S = T * k, num_slots(T, k, E)
    return min(P, (P + (n_tokens - 1) * S) // n_tokens)


def split_groups(slots_3S, T: int, k: int, E: int, n_tokens: int):
    """The slot table with each group cut into pieces of at most n_tokens rows, one token tile each: a group
    larger than a tile (a popular expert) then runs on as many CTAs side by side, not tile after tile in one
    CTA. [3, U] (U = num_pieces), the pieces of a group in row order, idle entries size 0. A group never has
    more than T rows (a token's choices are different experts), so for T <= n_tokens it is the table itself."""
    if T <= n_tokens:
        return slots_3S
    e, first, size = slots_3S
    n = (size + n_tokens - 1) // n_tokens  # pieces per slot
    g = jnp.arange(size.shape[0], dtype=I32)
    ends = _count(g[None, :] <= g[:, None], n[None, :])  # [g, g']: the pieces up to and including slot g
    u = jnp.arange(num_pieces(T, k, E, n_tokens), dtype=I32)
    slot = _count(ends[None, :] <= u[:, None])  # [u, g]: the slot piece u belongs to (S: none)
    j = u - jnp.take(ends - n, slot, mode="clip")  # its index within the group
    rows = jnp.take(size, slot, mode="fill", fill_value=0) - j * n_tokens
    return jnp.stack(
        [jnp.take(e, slot, mode="clip"), jnp.take(first, slot, mode="clip") + j * n_tokens, jnp.clip(rows, 0, n_tokens)]
    )


def pair_rows(x_TL, groups: Groups, k: int, num_experts: int, *, interpret=None):
    """x [T, L] -> [R, L]: token t's row at the rows of its k pairs (the padding rows unwritten)."""
    T, L = x_TL.shape
    if L % COPY_COLS:
        raise NotImplementedError(f"rows of {L} elements: pair_rows copies {COPY_COLS}-element pieces")
    R = num_rows(T, k, num_experts)

    def body(row_ref, x_ref, out_ref, buf, bar):
        t = lax.axis_index("t")
        plgpu.copy_gmem_to_smem(x_ref.at[t], buf, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        for j in range(k):
            plgpu.copy_smem_to_gmem(buf, out_ref.at[row_ref[t * k + j]])
        plgpu.wait_smem_to_gmem(0)

    pieces = (L // COPY_COLS, COPY_COLS)
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((R, *pieces), x_TL.dtype),
        scratch_types=[plgpu.SMEM(pieces, x_TL.dtype), plgpu.Barrier(num_barriers=1)],
        grid=(T,),
        grid_names=("t",),
        interpret=interpret,
    )
    return kernel(groups.row_P, x_TL.reshape(T, *pieces)).reshape(R, L)


def ungroup(y_RL, groups: Groups, T: int, k: int):
    """Rows in the kernels' aligned pair order [R, ...] -> [T, k, ...] in (token, choice) order."""
    return y_RL[groups.row_P].reshape(T, k, *y_RL.shape[1:])
