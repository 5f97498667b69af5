"""The K3 forward in plain JAX: the AttnRes decoder loop (docs/model.md §2.3) around KDA/MLA and dense/MoE layers.

- `forward`: full sequences, no cache (naive MLA, chunked KDA from a zero state): scoring and the reference.
- `extend`: T new tokens per sequence on top of a decode state (prefill chunks when T > 1, decode when T == 1),
  writing the MLA latent cache and advancing the KDA state and conv windows.
The 93-layer loop is unrolled in Python on purpose: a scan over layers costs ~16 us per iteration on GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from k3jax.comm import LOCAL, Comm
from k3jax.config import K3Config
from k3jax.layers import kda, mla, moe
from k3jax.layers.boundary import join
from k3jax.layers.common import ffn, linear, rms_norm

# Sublayer callbacks: attn(L, params, normed x [B,T,D]) -> this rank's o_proj partial [B,T,D]
AttnFn = Callable[[int, dict, jax.Array], jax.Array]


def embed(params, tokens_BT, dtype, comm: Comm = LOCAL):
    return comm.embed(params["embed"], tokens_BT).astype(dtype)


def logits_from_hidden(params, h_BTD, cfg: K3Config, comm: Comm = LOCAL):
    """lm_head on the trunk's final-normed hidden; vocab-split under tp: gather the logits for sampling."""
    logits = linear(h_BTD, params["lm_head"], "btd,dv->btv")
    return comm.all_gather(logits, axis=-1, what="logits")


def ffn_layer(p, x_BTD, cfg: K3Config, is_moe: bool, comm: Comm = LOCAL, record: dict | None = None):
    """This rank's partial of the MLP output (dense, or latent MoE + shared experts): the trunk all-reduces it."""
    if not is_moe:
        return ffn(x_BTD, p["gate"], p["up"], p["down"], cfg)
    B, T, D = x_BTD.shape
    y, sel = moe.moe(p, x_BTD.reshape(B * T, D), cfg, return_routing=True, comm=comm)
    if record is not None:
        record["experts"] = sel.reshape(B, T, -1)
    return y.reshape(B, T, D)


def trunk(
    params,
    x_BTD,
    cfg: K3Config,
    attn: AttnFn,
    taps: tuple[int, ...] = (),
    comm: Comm = LOCAL,
    record: dict | None = None,
):
    """AttnRes decoder loop. Returns (final hidden: output mix then final norm [B,T,D], {layer: P after it}).

    Each sublayer returns this rank's partial output; `join` all-reduces it into the prefix P and forms what
    the next sublayer reads: the AttnRes mix of the stored blocks and P under that sublayer's site, normed
    (one Pallas launch under latency_specialized). So the mix before layer L+1's attention happens at the end
    of layer L (in its named scope), with the blocks as they were before layer L+1's boundary snapshot.
    `record` (notebooks, debugging): a dict filled with per-layer AttnRes weights and expert choices."""
    eps = cfg.rms_norm_eps
    layers = params["layers"]
    blocks: list[jax.Array] = []
    P = x_BTD
    x = rms_norm(P, layers[0]["attn_norm"], eps)  # layer 0 has no stored block yet: it reads P unmixed
    tapped = {}
    for L, lp in enumerate(layers):
        rec = None if record is None else record.setdefault(L, {})
        if L + 1 < len(layers):  # what reads this layer's output: the next layer's attention ...
            site, norm, key = layers[L + 1]["attn_res"], layers[L + 1]["attn_norm"], "attn_res"
            site_rec = None if record is None else record.setdefault(L + 1, {})
        else:  # ... or the output mix and the final norm
            site, norm, key, site_rec = params["out_res"], params["final_norm"], "out_res", record
        with jax.named_scope(f"layer{L}_{cfg.layer_kind(L)}"):
            if cfg.is_block_boundary(L):
                blocks.append(P)  # the ENTERING prefix, not the mix
                P = None
            P, x = join(
                comm, attn(L, lp["attn"], x), lp["mlp_norm"], eps, "attn_out", P, blocks, lp["mlp_res"], rec, "mlp_res"
            )
            is_moe = cfg.is_moe(L)
            P, x = join(
                comm,
                ffn_layer(lp["ffn"], x, cfg, is_moe, comm, rec),
                norm,
                eps,
                "moe_out" if is_moe else "mlp_out",
                P,
                blocks,
                site,
                site_rec,
                key,
            )
            if L in taps:
                tapped[L] = P
    return x, tapped


def forward(params, tokens_BT, cfg: K3Config, dtype=jnp.bfloat16, comm: Comm = LOCAL, record: dict | None = None):
    """Full-sequence logits [B, T, V] (causal, from an empty state). `record`: see `trunk`."""
    B, T = tokens_BT.shape
    zeros = jnp.zeros((B,), jnp.int32)

    def attn(L, p, x):
        if cfg.is_mla(L):
            return mla.mla_full(p, x, cfg)
        H, K = p["A_log"].shape[0], cfg.kda_head_dim  # local heads under tp
        state = jnp.zeros((B, H, K, K), jnp.float32)
        window = jnp.zeros((B, 3, cfg.kda_conv_size - 1, H, K), dtype)
        return kda.kda_prefill(p, x, cfg, zeros + T, state, window)[0]

    h, _ = trunk(params, embed(params, tokens_BT, dtype, comm), cfg, attn, comm=comm, record=record)
    return logits_from_hidden(params, h, cfg, comm)


def extend(
    params,
    tokens_BT,
    n_new_B,
    cache: dict,
    cfg: K3Config,
    dtype=jnp.bfloat16,
    all_logits: bool = False,
    taps: tuple[int, ...] = (),
    comm: Comm = LOCAL,
):
    """Append tokens (right-padded; n_new_B real ones per sequence) to the decode state.

    Returns (logits [B, V] at each sequence's last new token, or [B, T, V] if all_logits; new cache; taps).
    Sequences with n_new == 0 are left exactly as they were. Which kernels run is comm's decode policy:
    `Comm(axis, policy)`, or `Comm(policy=...)` unsharded.
    """
    B, T = tokens_BT.shape
    start_B = cache["lengths"]
    pos_BT = start_B[:, None] + jnp.arange(T)[None]
    valid_BT = jnp.arange(T)[None] < n_new_B[:, None]
    new_layers = list(cache["layers"])

    def attn(L, p, x):
        entry = cache["layers"][L]
        if cfg.is_mla(L):
            q_a, kv, g = mla.mla_in_projections(p, x, comm.policy)
            entry = mla.write_latent_rows(p, kv, entry, pos_BT, valid_BT, comm.policy)
            new_layers[L] = entry
            return mla.mla_cached(p, q_a, g, cfg, entry, pos_BT + 1, comm.policy)  # the entry as stored
        if T == 1:
            out, state, conv = kda.kda_decode(
                p, x[:, 0], cfg, entry["state"], entry["conv"], comm.policy, active_B=n_new_B
            )  # idle slots keep their state
            out = out[:, None]
        else:
            out, state, conv = kda.kda_prefill(p, x, cfg, n_new_B, entry["state"], entry["conv"])
        new_layers[L] = {"state": state, "conv": conv}
        return out

    h, tapped = trunk(params, embed(params, tokens_BT, dtype, comm), cfg, attn, taps, comm)
    if not all_logits:
        last = jnp.maximum(n_new_B - 1, 0)
        h = jnp.take_along_axis(h, last[:, None, None], axis=1)
    logits = logits_from_hidden(params, h, cfg, comm)
    logits = logits if all_logits else logits[:, 0]
    new_cache = {"lengths": start_B + n_new_B, "layers": new_layers}
    return logits, new_cache, tapped
