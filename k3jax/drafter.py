"""Drafters for speculative decoding: the interface, a prompt-lookup n-gram drafter, the DSpark drafter (§9).

A drafter is a frozen dataclass (hashable: a static jit argument) holding only static settings; its weights
(`draft_params`, any pytree or None) and its per-sequence state are passed explicitly, so every method is a
pure function that runs inside the jitted speculative step.

Under tensor parallelism the methods run inside the step's shard_map: `target_params` are this rank's shards
(embedding and lm_head split by vocab), so anything read from them goes through `comm` (k3jax.comm). A drafter
with a `param_specs(tp)` method has its own weights split so (DSpark: by heads and FFN intermediate, each layer's
attention and FFN ending in an all-reduce); without one they are replicated. Drafter state is replicated on
every rank, and proposals must come out replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from k3jax import cache as cache_lib
from k3jax import model
from k3jax.comm import LOCAL, Comm
from k3jax.config import MLA_LOWRANK_EPS
from k3jax.drafter_params import DSparkConfig, param_specs, yarn_inv_freq, yarn_mscale
from k3jax.layers import mla
from k3jax.layers.common import F32, dot, linear, o_proj, rms_norm


class Proposal(NamedTuple):
    drafts_BK: jax.Array  # int32 draft tokens following the anchor
    q_BKV: jax.Array | None = None  # draft distributions (None: greedy drafter, q = one-hot of the drafts)
    confidence_BK: jax.Array | None = None  # P(draft accepted) estimates, when the drafter has a head for it


class Drafter(Protocol):
    taps: tuple[int, ...]  # 0-based target layers whose P (docs/model.md §2.6) the drafter reads; () for none

    def init_state(self, batch: int, max_len: int, dtype) -> Any:
        """Empty per-sequence state for `batch` slots of up to `max_len` target positions."""

    def observe(
        self, draft_params, target_params, state, tokens_BT, n_B, start_B, taps: dict, comm: Comm = LOCAL
    ) -> Any:
        """tokens_BT[b, :n_B[b]] are now committed at target positions start_B[b] + t; taps[L] [B,T,D] is
        the target's P after layer L at those rows (rows past n_B are junk and must be ignored)."""

    def propose(
        self,
        draft_params,
        target_params,
        state,
        anchor_B,
        pos_B,
        num_draft: int,
        key,
        temperature: float,
        comm: Comm = LOCAL,
    ) -> Proposal:
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

    def observe(self, draft_params, target_params, hist_BS, tokens_BT, n_B, start_B, taps, comm=LOCAL):
        T = tokens_BT.shape[1]
        t = jnp.arange(T)[None]
        pos = jnp.where(t < n_B[:, None], start_B[:, None] + t, hist_BS.shape[1])
        b = jnp.arange(hist_BS.shape[0])[:, None]
        return hist_BS.at[b, pos].set(tokens_BT.astype(jnp.int32), mode="drop")

    def propose(self, draft_params, target_params, hist_BS, anchor_B, pos_B, num_draft, key, temperature, comm=LOCAL):
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


# ---- DSpark (docs/model.md §9) ----------------------------------------------------------------------------


def rope_interleaved(x, pos, c: DSparkConfig):
    """YaRN RoPE on GPT-J interleaved pairs (2i, 2i+1); x [..., rope], pos broadcastable to x[..., 0]."""
    inv_freq = jnp.asarray(yarn_inv_freq(c), F32)
    ang = pos[..., None].astype(F32) * inv_freq
    m = yarn_mscale(c.rope_factor, c.rope_mscale) / yarn_mscale(c.rope_factor, c.rope_mscale_all_dim)
    cos, sin = jnp.cos(ang) * m, jnp.sin(ang) * m
    xf = x.astype(F32).reshape(*x.shape[:-1], -1, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    return jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(x.shape).astype(x.dtype)


def _latent_rows(p, x_BTD, pos_BT, c: DSparkConfig):
    """Cache rows [RMSNorm(c) | RoPE(k_pe)] (the drafter's k_pe IS rotated, unlike the target's)."""
    kv = linear(x_BTD, p["kv_a"], "btd,dr->btr")
    R = c.kv_lora_rank
    c_lat = rms_norm(kv[..., :R], p["kv_a_norm"], MLA_LOWRANK_EPS)
    return jnp.concatenate([c_lat, rope_interleaved(kv[..., R:], pos_BT, c)], axis=-1)


def _attention(p, x_BTD, pos_BT, ctx_rows_BSC, ctx_len_B, c: DSparkConfig, comm: Comm = LOCAL):
    """Absorbed MLA, no output gate: the block sees the context rows before the anchor and ALL block rows. With
    a part of the heads (param_specs under tp) the o projection is this rank's partial: all-reduced here."""
    N, R = c.qk_nope_head_dim, c.kv_lora_rank
    q = mla.queries(p, linear(x_BTD, p["q_a"], "btd,dq->btq"))  # the drafter's own table: q_a in-major
    q_lat = linear(q[..., :N], p["w_uk"], "bthn,hnr->bthr")
    q_pe = rope_interleaved(q[..., N:], pos_BT[:, :, None], c)
    # the context rows and the block's own are read where they lie: a concatenation of the rows copied the whole
    # context cache every layer (179 us a layer at 8 x 8K, bench/results/rank_slice_spec.json); the scores are few
    ctx, blk = ctx_rows_BSC.astype(x_BTD.dtype), _latent_rows(p, x_BTD, pos_BT, c)

    def scores(rows_BSC):  # -> [B, H, T, S]
        lat, k_pe = rows_BSC[..., :R], rows_BSC[..., R:]
        return (dot("bthr,bsr->bhts", q_lat, lat) + dot("bthe,bse->bhts", q_pe, k_pe)) * c.softmax_scale

    S = ctx.shape[1]
    ctx_visible = jnp.arange(S)[None] < ctx_len_B[:, None]
    s_ctx = jnp.where(ctx_visible[:, None, None], scores(ctx), -jnp.inf)
    probs = jax.nn.softmax(jnp.concatenate([s_ctx, scores(blk)], axis=-1), axis=-1).astype(x_BTD.dtype)
    pv = dot("bhts,bsr->bthr", probs[..., :S], ctx[..., :R]) + dot("bhts,bsr->bthr", probs[..., S:], blk[..., :R])
    o_lat = pv.astype(x_BTD.dtype)
    out = o_proj(linear(o_lat, p["w_uv"], "bthr,hvr->bthv"), p["o"])  # the target's o_proj (no decode policy)
    return comm.all_reduce(out, "draft_attn") if p["o"].shape[1] < c.num_attention_heads else out


_ACT = {"silu": jax.nn.silu, "gelu": jax.nn.gelu}


def _ffn(p, x, c: DSparkConfig, comm: Comm = LOCAL):
    """The gated MLP; with a part of the intermediate (param_specs under tp) its down projection's partial is
    all-reduced here."""
    g = linear(x, p["gate"], "btd,df->btf").astype(F32)
    h = (_ACT[c.hidden_act](g) * linear(x, p["up"], "btd,df->btf").astype(F32)).astype(x.dtype)
    out = linear(h, p["down"], "btf,fd->btd")
    return comm.all_reduce(out, "draft_ffn") if p["down"].shape[0] < c.intermediate_size else out


def dspark_context(dp, taps: dict, c: DSparkConfig, dtype):
    """ctx = RMSNorm(context_proj(concat of the tapped target P, in target_layer_ids order))."""
    cat = jnp.concatenate([taps[L].astype(dtype) for L in c.target_layer_ids], axis=-1)
    return rms_norm(linear(cat, dp["context_proj"], "btc,cd->btd"), dp["context_norm"], c.rms_norm_eps)


def dspark_block(
    dp, target_params, rows, ctx_len_B, anchor_B, pos_B, num_draft: int, c: DSparkConfig, dtype, comm: Comm = LOCAL
):
    """Draft layers over [anchor, mask, ...] -> (post-final_norm hidden [B,K,D], base logits U [B,K,V]).
    The target's vocab-split embedding and lm_head go through comm; U comes back gathered (whole vocab)."""
    B, eps = anchor_B.shape[0], c.rms_norm_eps
    masks = jnp.full((B, num_draft - 1), c.mask_token_id, anchor_B.dtype)
    ids = jnp.concatenate([anchor_B[:, None], masks], axis=1)
    pos_BT = pos_B[:, None] + jnp.arange(num_draft)[None]
    x = model.embed(target_params, ids, dtype, comm)
    for lp, rows_j in zip(dp["layers"], rows, strict=True):
        x = x + _attention(lp["attn"], rms_norm(x, lp["attn_norm"], eps), pos_BT, rows_j, ctx_len_B, c, comm)
        x = x + _ffn(lp["ffn"], rms_norm(x, lp["mlp_norm"], eps), c, comm)
    h = rms_norm(x, dp["final_norm"], eps)
    return h, comm.all_gather(linear(h, target_params["lm_head"], "btd,dv->btv"), axis=-1, what="draft_logits")


@dataclass(frozen=True)
class DSparkDrafter:
    """DSpark: context KV from tapped target states, one non-causal block pass, sequential Markov head.
    Under tp its layers are split as the target's (param_specs: 2.39 B parameters at release, ~4.8 GB bf16 of
    which the five layers' ~4.1 GB are split; replicated, each rank read them all every round)."""

    config: DSparkConfig

    def param_specs(self, tp: int):
        return param_specs(self.config, tp)

    @property
    def taps(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    def init_state(self, batch, max_len, dtype):
        C = self.config.kv_lora_rank + self.config.qk_rope_head_dim
        return {
            "rows": [jnp.zeros((batch, max_len, C), dtype) for _ in range(self.config.num_hidden_layers)],
            "lengths": jnp.zeros((batch,), jnp.int32),
        }

    def observe(self, dp, target_params, state, tokens_BT, n_B, start_B, taps, comm=LOCAL):
        """Context KV injection (§9.3 step 2): the context only passes through each layer's kv_a + norm."""
        c = self.config
        dtype = state["rows"][0].dtype
        T = tokens_BT.shape[1]
        pos_BT = start_B[:, None] + jnp.arange(T)[None]
        valid_BT = jnp.arange(T)[None] < n_B[:, None]
        ctx = dspark_context(dp, taps, c, dtype)
        rows = []
        for lp, r in zip(dp["layers"], state["rows"], strict=True):
            new = _latent_rows(lp["attn"], ctx, pos_BT, c)
            rows.append(cache_lib.write_rows({"rows": r}, new, pos_BT, valid_BT, c.kv_lora_rank)["rows"])
        return {"rows": rows, "lengths": jnp.maximum(state["lengths"], start_B + n_B)}

    def propose(self, dp, target_params, state, anchor_B, pos_B, num_draft, key, temperature, comm=LOCAL):
        c = self.config
        dtype = state["rows"][0].dtype
        h, U = dspark_block(dp, target_params, state["rows"], pos_B, anchor_B, pos_B, num_draft, c, dtype, comm)
        prev, drafts, qs, confs = anchor_B, [], [], []
        for i in range(num_draft):  # the serial part: row i's logits + the Markov bias of its predecessor
            e = dp["markov_w1"][prev].astype(dtype)
            logits = (U[:, i] + linear(e, dp["markov_w2"], "br,vr->bv")).astype(F32)
            if temperature == 0.0:
                tok = jnp.argmax(logits, axis=-1)
            else:
                key, sub = jax.random.split(key)
                tok = jax.random.categorical(sub, logits / temperature)
                qs.append(jax.nn.softmax(logits / temperature, axis=-1))
            if c.enable_confidence_head:
                feat = jnp.concatenate([h[:, i], e], -1) if c.confidence_head_with_markov else h[:, i]
                confs.append(
                    jax.nn.sigmoid(jnp.sum(feat.astype(F32) * dp["conf_w"].astype(F32), -1) + dp["conf_b"].astype(F32))
                )
            prev = tok.astype(anchor_B.dtype)
            drafts.append(prev)
        stack = lambda xs: jnp.stack(xs, axis=1) if xs else None  # noqa: E731
        return Proposal(jnp.stack(drafts, axis=1).astype(jnp.int32), stack(qs), stack(confs))
