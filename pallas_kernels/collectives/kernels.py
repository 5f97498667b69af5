"""Pallas Mosaic GPU all-reduce kernels for decode-sized activations (no multicast).

Every kernel runs inside `jax.shard_map` over a mesh axis of n ranks and works on a 2-D view x_MC of the
flattened activation (C = 128 lanes, 256 B rows in BF16). A grid of CTAs splits the M rows into blocks of R
rows; each CTA owns one block and one block-local semaphore, so CTAs never wait on each other.

Protocol (push, one-shot): a CTA TMA-stores its block into slot `me` of every peer's receive buffer `recv`
(a kernel output, so XLA exchanges its address), waits for the stores to land, signals the peer's semaphore
for that block, waits for n-1 signals on its own, then sums the n slots in rank order 0..n-1 in FP32. The
fixed order makes every rank's result bit-identical.

Why the XLA device barrier stays on: in jax 0.11.2 the "global" semaphores and the receive buffers are both
per-call XLA buffers (the semaphores are zero-filled by a memset just before the kernel). A peer that signals
or writes before this rank's kernel starts could hit memory that an earlier op still uses, or a semaphore
the memset then wipes. The barrier kernel XLA inserts before the call is what makes the push safe; removing
it needs persistent symmetric memory (see bench/NOTES.md, "Collectives").

Back-to-back safety: each call signals every semaphore exactly n-1 times (one-shot) and every wait consumes
what it waits for, and each call's semaphores/buffers are private to that call; so no call can observe a
signal or data from another.

A multicast variant would replace the n-1 peer stores + signals by one `multicast_ref` store and
`semaphore_signal_multicast`; the slot layout and the wait/sum phase stay the same.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

LANES = 128  # elements per tile row


def _peers(me, n, axis_name):
    """Device ids of the n-1 peers, nearest first (dict form works on multi-axis meshes)."""
    return [{axis_name: lax.rem(me + k, n)} for k in range(1, n)]


def _push_block(src_smem, recv_gmem, me, rows, peers, sem):
    """TMA-store my block into slot `me` of each peer's recv, wait until it landed, then signal."""
    for peer in peers:
        plgpu.copy_smem_to_gmem(src_smem, plgpu.remote_ref(recv_gmem, peer).at[me, rows])
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)
    for peer in peers:
        pl.semaphore_signal(sem, device_id=peer)


def _gather_and_sum(recv_gmem, buf_nRC, bars, me, rows, n):
    """Load the peers' slots (mine is already in buf[me]) and sum all n in rank order, in FP32.

    `rows` is a row slice or, in the fused kernel, a token index.
    """
    for r in range(n):

        @pl.when(me != r)
        def _load(r=r):  # pl.when runs the body at trace time; r is bound for the linter
            plgpu.copy_gmem_to_smem(recv_gmem.at[r, rows], buf_nRC.at[r], bars.at[r])

    for r in range(n):

        @pl.when(me != r)
        def _wait(r=r):
            plgpu.barrier_wait(bars.at[r])

    acc = buf_nRC[0].astype(jnp.float32)
    for r in range(1, n):
        acc = acc + buf_nRC[r].astype(jnp.float32)
    return acc


def one_shot(x_MC, *, axis_name, n, block_rows):
    """All-reduce of x_MC over `axis_name` (n ranks): every rank pushes its data to every peer."""
    M, C = x_MC.shape
    R = block_rows
    dtype = x_MC.dtype

    def body(x_gmem, y_gmem, recv_gmem, sem):
        me = lax.axis_index(axis_name)
        rows = pl.ds(lax.axis_index("blocks") * R, R)

        def scoped(buf_nRC, out_RC, bars):
            plgpu.copy_gmem_to_smem(x_gmem.at[rows], buf_nRC.at[me], bars.at[me])
            plgpu.barrier_wait(bars.at[me])
            _push_block(buf_nRC.at[me], recv_gmem, me, rows, _peers(me, n, axis_name), sem)
            pl.semaphore_wait(sem, n - 1)
            acc = _gather_and_sum(recv_gmem, buf_nRC, bars, me, rows, n)
            out_RC[...] = acc.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_RC, y_gmem.at[rows])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM((n, R, C), dtype), plgpu.SMEM((R, C), dtype), plgpu.Barrier(num_barriers=n))

    y, _ = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((M, C), dtype), jax.ShapeDtypeStruct((n, M, C), dtype)),
        scratch_types=[plgpu.SemaphoreType.REGULAR],
        grid=(M // R,),
        grid_names=("blocks",),
    )(x_MC)
    return y


def one_shot_add_rmsnorm(x_BQC, res_BQC, w_QC, eps, *, axis_name, n):
    """One-shot all-reduce fused with residual add and RMSNorm; one CTA per token row.

    x_BQC / res_BQC: a token's D = Q*128 features as a (Q, 128) tile. Returns (new_residual, normed) with
    new = round(res + sum) and normed = round(round(new * rsqrt(mean(new^2) + eps)) * w), as the reference.
    """
    B, Q, C = x_BQC.shape
    D = Q * C
    dtype = x_BQC.dtype
    rdtype = res_BQC.dtype

    def body(x_gmem, res_gmem, w_gmem, new_gmem, normed_gmem, recv_gmem, sem):
        me = lax.axis_index(axis_name)
        b = lax.axis_index("blocks")

        def scoped(buf_nQC, res_QC, w_QC_s, new_QC, normed_QC, bars, in_bar):
            plgpu.copy_gmem_to_smem(x_gmem.at[b], buf_nQC.at[me], bars.at[me])
            # residual and weight load while the exchange runs.
            plgpu.copy_gmem_to_smem(res_gmem.at[b], res_QC, in_bar.at[0])
            plgpu.copy_gmem_to_smem(w_gmem, w_QC_s, in_bar.at[1])
            plgpu.barrier_wait(bars.at[me])
            _push_block(buf_nQC.at[me], recv_gmem, me, b, _peers(me, n, axis_name), sem)
            pl.semaphore_wait(sem, n - 1)
            acc = _gather_and_sum(recv_gmem, buf_nQC, bars, me, b, n)
            plgpu.barrier_wait(in_bar.at[0])
            plgpu.barrier_wait(in_bar.at[1])
            new = (res_QC[...].astype(jnp.float32) + acc).astype(rdtype)
            new_f32 = new.astype(jnp.float32)
            inv = lax.rsqrt(jnp.sum(new_f32 * new_f32) * (1.0 / D) + eps)
            normed = (new_f32 * inv).astype(rdtype).astype(jnp.float32) * w_QC_s[...].astype(jnp.float32)
            new_QC[...] = new
            normed_QC[...] = normed.astype(rdtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(new_QC, new_gmem.at[b])
            plgpu.copy_smem_to_gmem(normed_QC, normed_gmem.at[b])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            scoped,
            plgpu.SMEM((n, Q, C), dtype),
            plgpu.SMEM((Q, C), rdtype),
            plgpu.SMEM((Q, C), w_QC.dtype),
            plgpu.SMEM((Q, C), rdtype),
            plgpu.SMEM((Q, C), rdtype),
            plgpu.Barrier(num_barriers=n),
            plgpu.Barrier(num_barriers=2),
        )

    new, normed, _ = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((B, Q, C), rdtype),
            jax.ShapeDtypeStruct((B, Q, C), rdtype),
            jax.ShapeDtypeStruct((n, B, Q, C), dtype),
        ),
        scratch_types=[plgpu.SemaphoreType.REGULAR],
        grid=(B,),
        grid_names=("blocks",),
    )(x_BQC, res_BQC, w_QC)
    return new, normed


def exchange_st(src_ref, recv_gmem, idx, axis_name, n, sem):
    """Plain-store one-shot exchange of one block: src_ref's block goes into slot `me` of every rank's recv (its
    own too) at index idx, then signal, wait for n-1 signals, and return the n slots summed in rank order, FP32.

    No TMA: a TMA store to a peer needs an in-kernel descriptor for the remote address and a bulk wait for
    remote completion; plain stores ordered by the signal's release (red.release.sys after a warpgroup
    barrier) skip both. Every slot, mine included, is read back with plain loads, so writes and reads stay in
    the generic proxy.
    """
    me = lax.axis_index(axis_name)
    mine = src_ref[...]
    peers = _peers(me, n, axis_name)
    for peer in peers:
        plgpu.remote_ref(recv_gmem, peer).at[(me, *idx)][...] = mine
    recv_gmem.at[(me, *idx)][...] = mine
    for peer in peers:
        pl.semaphore_signal(sem, device_id=peer)
    pl.semaphore_wait(sem, n - 1)
    acc = recv_gmem.at[(0, *idx)][...].astype(jnp.float32)
    for r in range(1, n):
        acc = acc + recv_gmem.at[(r, *idx)][...].astype(jnp.float32)
    return acc


def one_shot_st(x_MC, *, axis_name, n, block_rows):
    """One-shot with plain register loads/stores only (no SMEM, no TMA): see exchange_st. Latency variant."""
    M, C = x_MC.shape
    R = block_rows
    dtype = x_MC.dtype

    def body(x_gmem, y_gmem, recv_gmem, sem):
        rows = pl.ds(lax.axis_index("blocks") * R, R)
        y_gmem[rows] = exchange_st(x_gmem.at[rows], recv_gmem, (rows,), axis_name, n, sem).astype(dtype)

    y, _ = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((M, C), dtype), jax.ShapeDtypeStruct((n, M, C), dtype)),
        scratch_types=[plgpu.SemaphoreType.REGULAR],
        grid=(M // R,),
        grid_names=("blocks",),
    )(x_MC)
    return y


KERNELS = {"one_shot": one_shot, "one_shot_st": one_shot_st}
