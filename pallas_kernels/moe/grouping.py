"""Tokens grouped by expert on the device (no host sync): the slot table the grouped-experts kernels walk and the
rows their token tiles read.

Pair p = t k + j is token t's j-th choice, expert e_p. The groups keep token order and are laid out in an
aligned pair order of R rows: each group starts on a multiple of ALIGN (the kernels' token tiles are TMA boxes
of an (8, 64)-tiled SMEM layout, and a box that started off an 8-row boundary loaded zeros past the first tile
boundary on the H200: bench/results/moe_layer.md's first run; "aligned group tables"). In XLA, compare-sum
fusions in pair and expert space, no sort, cumsum or scatter (the sort-and-cumsum form took ~14 kernels, ~25 us,
at every T; the pair-space form that followed, 11 kernels, ~18 us at T = 64 in the H200 rank slice):

1. before_p = #{q < p : e_q = e_p} (p's rank in its group, [P, P] compares) and size_e = #{p : e_p = e}
   ([E, P]);
2. over the experts in ascending order ([E, E]): each group's first row, the sum of the ALIGN-rounded sizes of
   the groups below it, and its first piece, the sum of the pieces below it (a piece: at most piece_rows rows,
   one token tile; without split_groups a whole group); row_p = first row of e_p + before_p;
3. the slot table [3, U] (expert, first row, rows) of the pieces in expert order ([U, E]); U static: the
   number of slots, min(E, T k), or split_groups' bound on its pieces; the entries past the chosen experts'
   pieces are (0, 0, 0): their CTAs exit.

[P, P] compares (P = T k): 1 M at T = 64, 67 M at T = 512, each one fused pass; [E, P] and [E, E] ~1 M, [U, E] up
to ~1.2 M x 3. One token (T = 1) needs none of it: its k choices are k different experts (top-k), each its own
group of one; a repeated id would only make its expert's bytes read twice, never a wrong sum.

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


def num_pieces(T: int, k: int, E: int, n_tokens: int) -> int:
    """Entries of a table of pieces of at most n_tokens rows: at most every group's ceil(size / n_tokens),
    sum(size) = T k."""
    P, S = T * k, num_slots(T, k, E)
    return min(P, (P + (n_tokens - 1) * S) // n_tokens)


def group_by_expert(sel_Tk, num_experts: int, piece_rows: int | None = None) -> Groups:
    """The pairs grouped by expert (the module's steps). piece_rows (split_groups): each group cut into pieces of
    at most that many rows, one token tile each, so a group larger than a tile (a popular expert) runs on as many
    CTAs side by side, not tile after tile in one CTA: the table is then [3, num_pieces], the pieces of a group in
    row order. A group never has more than T rows (a token's choices are different experts), so for
    T <= piece_rows the pieces are the groups and the table the slots [3, num_slots]."""
    T, k = sel_Tk.shape
    e = sel_Tk.reshape(-1).astype(I32)
    if T == 1 and k <= num_experts:
        return pair_slots(sel_Tk)
    p = jnp.arange(T * k, dtype=I32)
    before = _count((e[:, None] == e[None, :]) & (p[None, :] < p[:, None]))
    ex = jnp.arange(num_experts, dtype=I32)
    size = _count(ex[:, None] == e[None, :])  # [E]
    split = piece_rows is not None and T > piece_rows
    n = piece_rows if split else T  # a piece's most rows: without split_groups a group is one piece
    pieces = (size + n - 1) // n
    padded = (size + ALIGN - 1) // ALIGN * ALIGN
    below = ex[None, :] < ex[:, None]  # [e, e']: e' is a smaller expert
    first_row, first_piece = (_count(below, v[None, :]) for v in (padded, pieces))
    U = num_pieces(T, k, num_experts, n) if split else num_slots(T, k, num_experts)
    j = jnp.arange(U, dtype=I32)[:, None] - first_piece[None, :]  # [u, e]: u's index among e's pieces
    owns = (j >= 0) & (j < pieces[None, :])
    entry = jnp.stack([jnp.broadcast_to(ex, j.shape), first_row + j * n, jnp.clip(size - j * n, 0, n)])
    return Groups(row_P=first_row[e] + before, slots_3S=jnp.sum(jnp.where(owns, entry, 0), axis=-1, dtype=I32))


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
