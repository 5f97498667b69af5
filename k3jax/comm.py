"""Explicit tensor-parallel collectives for the model code.

Inside `jax.shard_map` over the "tp" mesh axis the model's activations are replicated and weights are split
(heads, FFN intermediates, vocab, router experts, latent projections); each row-parallel projection ends in an
all-reduce (at a sublayer boundary fused with what follows: k3jax/layers/boundary.py) and each column-split
that feeds a nonlinearity over the whole axis ends in an all-gather.
`Comm(None)` is the single-device no-op, so the same model code runs sharded and unsharded.
`counts` records the collectives traced per step (for the per-layer accounting in benchmarks and tests).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from pallas_kernels.policy import XLA, DecodePolicy


@dataclass(frozen=True)
class Comm:
    axis: str | None = None  # mesh axis name inside shard_map, None when unsharded
    policy: DecodePolicy = XLA  # one asking for kernels routes all-reduces to pallas_kernels.collectives
    counts: Counter = field(default_factory=Counter, compare=False, hash=False)

    @property
    def sharded(self) -> bool:
        return self.axis is not None

    @property
    def fuses_boundaries(self) -> bool:
        """Layer boundaries (all-reduce + AttnRes + RMSNorm, k3jax/layers/boundary.py) through the one-launch api
        (pallas_kernels.collectives.api.all_reduce_mix_norm): wherever the policy asks for kernels, sharded or
        not. Unsharded the kernel runs without its exchange, where the collectives tuning allows it
        (mix_norm_single_device; the api falls back to the same XLA maths otherwise)."""
        return self.policy.kernels

    @property
    def exchange_axis(self) -> str | None:
        """The axis a fused kernel exchanges over (None: one device, no exchange)."""
        return self.axis

    def note_fused(self, what: str, x) -> None:
        """Count an all-reduce of x that runs inside a fused kernel (a layer boundary's): one happens only when
        sharded, as in all_reduce."""
        if self.sharded:
            self.counts[what] += 1

    def all_reduce(self, x, what: str = "all_reduce"):
        if not self.sharded:
            return x
        self.counts[what] += 1
        from pallas_kernels.collectives import api

        return api.all_reduce(x, self.axis, policy=self.policy)

    def all_gather(self, x, axis: int, what: str = "all_gather"):
        if not self.sharded:
            return x
        self.counts[what] += 1
        return jax.lax.all_gather(x, self.axis, axis=axis % x.ndim, tiled=True)

    def local_start(self, size: int):
        """Where this rank's contiguous block of `size` starts along an axis of a replicated array (traced), or
        None unsharded (the whole array is the rank's): a consumer reads its block in place (gemv_sum's
        x_starts), so no slice kernel runs."""
        if not self.sharded:
            return None
        return jax.lax.axis_index(self.axis) * size

    def embed(self, table_VD, tokens):
        """Lookup in a vocab-split table: each rank serves its rows, zeros elsewhere, then one all-reduce."""
        if not self.sharded:
            return table_VD[tokens]
        Vl = table_VD.shape[0]
        local = tokens - jax.lax.axis_index(self.axis) * Vl
        ok = (local >= 0) & (local < Vl)
        rows = jnp.where(ok[..., None], table_VD[jnp.clip(local, 0, Vl - 1)], 0)
        return self.all_reduce(rows, "embed")


LOCAL = Comm()
