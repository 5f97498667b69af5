"""On-device sampling: greedy, temperature, top-k, top-p (nucleus), seeded. Jittable, batched, no host sync."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


class SamplingError(ValueError):
    pass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):  # NaN fails too; inf would sample uniformly, ignoring the model
            raise SamplingError(f"temperature must be >= 0 and finite (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_logits(logits_BV, sp: SamplingParams):
    """fp32 logits / temperature with everything outside top-k / top-p set to -inf."""
    x = logits_BV.astype(jnp.float32) / sp.temperature
    if 0 < sp.top_k < x.shape[-1]:  # top_k >= vocab keeps everything (lax.top_k would refuse k > vocab)
        kth = jax.lax.top_k(x, sp.top_k)[0][:, -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if sp.top_p < 1.0:
        order = jnp.argsort(-x, axis=-1)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        probs = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        keep_sorted = before < sp.top_p  # always keeps the top token
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(x.shape[0])[:, None], order].set(keep_sorted)
        x = jnp.where(keep, x, -jnp.inf)
    return x


def sample(logits_BV, key, sp: SamplingParams):
    """-> token ids [B] int32."""
    if sp.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits_BV, sp), axis=-1).astype(jnp.int32)


def probs(logits_BV, sp: SamplingParams):
    """The distribution `sample` draws from (one-hot for greedy): used by speculative acceptance."""
    if sp.greedy:
        return jax.nn.one_hot(jnp.argmax(logits_BV, axis=-1), logits_BV.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(filtered_logits(logits_BV, sp), axis=-1)
