"""Drafters for speculative decoding: the interface, a prompt-lookup n-gram drafter, the DSpark drafter (§9).

A drafter is a frozen dataclass (hashable: a static jit argument) holding only static settings; its weights
(`draft_params`, any pytree or None) and its per-sequence state are passed explicitly, so every method is a
pure function that runs inside the jitted speculative step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp


class Proposal(NamedTuple):
    drafts_BK: jax.Array  # int32 draft tokens following the anchor
    q_BKV: jax.Array | None = None  # draft distributions (None: greedy drafter, q = one-hot of the drafts)
    confidence_BK: jax.Array | None = None  # P(draft accepted) estimates, when the drafter has a head for it


class Drafter(Protocol):
    taps: tuple[int, ...]  # 0-based target layers whose P (K3_SPEC §2.6) the drafter reads; () for none

    def init_state(self, batch: int, max_len: int, dtype) -> Any:
        """Empty per-sequence state for `batch` slots of up to `max_len` target positions."""

    def observe(self, draft_params, target_params, state, tokens_BT, n_B, start_B, taps: dict) -> Any:
        """tokens_BT[b, :n_B[b]] are now committed at target positions start_B[b] + t; taps[L] [B,T,D] is
        the target's P after layer L at those rows (rows past n_B are junk and must be ignored)."""

    def propose(self, draft_params, target_params, state, anchor_B, pos_B, num_draft: int, key,
                temperature: float) -> Proposal:
        """Draft num_draft tokens following anchor_B, which sits at target position pos_B."""


# ---- prompt lookup (n-gram) -------------------------------------------------------------------------------


@dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens (anchor included),
    longest n first, and propose the tokens that followed it. No match: repeat the anchor."""
    max_ngram: int = 3
    min_ngram: int = 1
    taps: tuple[int, ...] = ()

    def init_state(self, batch, max_len, dtype):
        return jnp.full((batch, max_len), -1, jnp.int32)  # token history by position (-1: none yet)

    def observe(self, draft_params, target_params, hist_BS, tokens_BT, n_B, start_B, taps):
        T = tokens_BT.shape[1]
        t = jnp.arange(T)[None]
        pos = jnp.where(t < n_B[:, None], start_B[:, None] + t, hist_BS.shape[1])
        b = jnp.arange(hist_BS.shape[0])[:, None]
        return hist_BS.at[b, pos].set(tokens_BT.astype(jnp.int32), mode="drop")

    def propose(self, draft_params, target_params, hist_BS, anchor_B, pos_B, num_draft, key, temperature):
        B, S = hist_BS.shape
        b = jnp.arange(B)
        hist = hist_BS.at[b, pos_B].set(anchor_B.astype(jnp.int32), mode="drop")
        j = jnp.arange(S)[None]  # candidate end of an earlier occurrence
        best = jnp.full((B,), -1)
        for n in range(self.min_ngram, self.max_ngram + 1):  # longer n overrides: checked last
            match = (j >= n - 1) & (j < pos_B[:, None]) & (pos_B[:, None] >= n - 1)
            for o in range(n):
                cur = jnp.take_along_axis(hist, jnp.maximum(pos_B - o, 0)[:, None], axis=1)
                match &= jnp.take_along_axis(hist, jnp.maximum(j - o, 0).repeat(B, 0), axis=1) == cur
            last = jnp.max(jnp.where(match, j, -1), axis=1)
            best = jnp.where(last >= 0, last, best)
        follow = best[:, None] + 1 + jnp.arange(num_draft)[None]
        follow = jnp.minimum(follow, pos_B[:, None])  # never read past the anchor
        drafts = jnp.take_along_axis(hist, follow, axis=1)
        return Proposal(jnp.where(best[:, None] >= 0, drafts, anchor_B[:, None]).astype(jnp.int32))
