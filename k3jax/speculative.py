"""Speculative decoding (docs/model.md §9.4): verify a drafted block in one target forward, accept, commit.

One step, per sequence b with `len_b` tokens in the target cache and an `anchor_b` (sampled, not yet cached):
  1. the drafter proposes K tokens d_1..d_K following the anchor;
  2. `verify` runs the target over [anchor, d_1..d_K] at positions len..len+K: MLA rows are written into the
     cache (causal inside the block), KDA runs the block from the committed state WITHOUT changing it and
     keeps what a commit needs; logits at all K+1 rows (row i predicts the token after block token i);
  3. `accept_*` picks n_acc in [0, K] accepted drafts and the next token (correction or bonus) on device;
  4. `commit` makes the anchor + the n_acc accepted drafts part of the state: lengths += n_acc + 1 (later MLA
     rows stay invisible and are overwritten), KDA state and conv window advance by exactly n_acc + 1 tokens.
The next token becomes the new anchor. `generate` runs the whole loop in one jitted while_loop.

Tensor parallelism (SpecConfig.mesh): prefill, step and loop each run as ONE `jax.shard_map` program over the
"tp" axis, with the target's collectives (k3jax.comm) inside. Only the KDA state and conv windows are split
(by heads, as k3jax.sharding.cache_specs), and the drafter's weights where it says how (DSpark: split as the
target's); the MLA cache, the drafter's state, tokens, keys and counters are replicated, and the verify logits
are all-gathered, so acceptance runs identically on every rank. verify's pending commit data (split by heads)
never leave the step program.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from k3jax import cache as cache_lib
from k3jax import model
from k3jax import sampling as sampling_lib
from k3jax import sharding as sh
from k3jax.comm import LOCAL, Comm
from k3jax.config import K3Config
from k3jax.layers import kda, mla
from k3jax.layers.common import o_proj
from k3jax.params import experts_format
from k3jax.sampling import SamplingParams
from pallas_kernels.kda_decode import api as kda_api
from pallas_kernels.policy import XLA, DecodePolicy, as_policy

# ---- 1. verify: one target forward over [anchor + K drafts] ------------------------------------------------


def verify(
    params,
    block_BT,
    cache: dict,
    cfg: K3Config,
    dtype=jnp.bfloat16,
    taps: tuple[int, ...] = (),
    comm: Comm = LOCAL,
):
    """Target forward over the block at positions len..len+T-1 of every sequence (this rank's shards under
    tp: the logits come back gathered, commit data hold this rank's KDA heads).

    Returns (logits [B,T,V], pending, taps {layer: P [B,T,D]}). `pending` is the cache with the block's MLA
    rows written but lengths unchanged, plus per-KDA-layer commit data: pass it to `commit`.
    """
    B, T = block_BT.shape
    pos_BT = cache["lengths"][:, None] + jnp.arange(T)[None]
    all_valid = jnp.ones((B, T), bool)
    layers = list(cache["layers"])
    commit_data = {}

    def attn(L, p, x):
        entry = cache["layers"][L]
        if cfg.is_mla(L):
            q_a, kv, g = mla.mla_in_projections(p, x, comm.policy)
            entry = mla.write_latent_rows(p, kv, entry, pos_BT, all_valid, comm.policy)
            layers[L] = entry
            return mla.mla_cached(p, q_a, g, cfg, entry, pos_BT + 1, comm.policy)  # causal inside the block
        qkv, f, beta, gate = kda.project(p, x)
        y, commit_data[L] = kda_api.kda_verify(
            qkv,
            f,
            beta,
            gate,
            entry["state"],
            entry["conv"],
            p["conv"],
            p["A_log"],
            p["dt_bias"],
            p["o_norm"],
            eps=cfg.rms_norm_eps,
            policy=comm.policy,
        )
        return o_proj(y, p["o"], comm.policy)  # the decode GEMV for B x T tokens where the policy asks

    h, tapped = model.trunk(params, model.embed(params, block_BT, dtype, comm), cfg, attn, taps, comm)
    logits = model.logits_from_hidden(params, h, cfg, comm)
    pending = {"lengths": cache["lengths"], "layers": layers, "kda_commit": commit_data}
    return logits, pending, tapped


def commit(pending: dict, n_commit_B, policy: DecodePolicy = XLA) -> dict:
    """Advance every sequence by n_commit_B[b] block tokens (anchor + accepted drafts; 0 = unchanged)."""
    layers = list(pending["layers"])
    for L, data in pending["kda_commit"].items():
        state, conv = kda_api.kda_commit(layers[L]["state"], layers[L]["conv"], data, n_commit_B, policy=policy)
        layers[L] = {"state": state, "conv": conv}
    return {"lengths": pending["lengths"] + n_commit_B, "layers": layers}


# ---- 2. acceptance (gpt-fast style; all [B, ...] on device, per-sequence results) -------------------------


def _first_rejection(accept_BK):
    """Number of leading accepted drafts per sequence."""
    return jnp.sum(jnp.cumprod(accept_BK.astype(jnp.int32), axis=-1), axis=-1)


def _row(x_BT, n_B):
    return jnp.take_along_axis(x_BT, n_B[:, None, None] if x_BT.ndim == 3 else n_B[:, None], axis=1)[:, 0]


def accept_greedy(logits_BTV, drafts_BK):
    """Exact match against the target argmax. -> (n_acc [B], next token [B])."""
    target_BT = jnp.argmax(logits_BTV, axis=-1).astype(drafts_BK.dtype)
    n_acc = _first_rejection(drafts_BK == target_BT[:, :-1])
    return n_acc, _row(target_BT, n_acc)


def _sp(sampling) -> SamplingParams:
    return sampling if isinstance(sampling, SamplingParams) else SamplingParams(temperature=float(sampling))


def accept_rejection(key, logits_BTV, drafts_BK, q_BKV, sampling: float | SamplingParams):
    """Lossless rejection sampling (Leviathan et al. / Chen et al.): accept d_i w.p. min(1, p_i/q_i); on the
    first rejection resample from normalize(max(0, p_i - q_i)); all accepted -> bonus from p_{K+1}.
    p is the distribution plain sampling draws from (temperature, top-k, top-p applied)."""
    k_u, k_tok = jax.random.split(key)
    B, T, V = logits_BTV.shape
    p_BTV = sampling_lib.probs(logits_BTV.reshape(B * T, V), _sp(sampling)).reshape(B, T, V)
    p_d = jnp.take_along_axis(p_BTV[:, :-1], drafts_BK[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q_BKV, drafts_BK[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(k_u, drafts_BK.shape)
    n_acc = _first_rejection(u * q_d < p_d)  # u < p/q without dividing by q
    q_pad = jnp.concatenate([q_BKV, jnp.zeros_like(q_BKV[:, :1])], axis=1)  # row K: residual = p (the bonus)
    resid = _row(jnp.maximum(p_BTV - q_pad, 0.0), n_acc)
    mass = jnp.sum(resid, axis=-1, keepdims=True)
    resid = jnp.where(mass > 0, resid / jnp.maximum(mass, 1e-30), _row(p_BTV, n_acc))  # p == q: never rejects
    return n_acc, jax.random.categorical(k_tok, jnp.log(resid)).astype(drafts_BK.dtype)


def synthetic_rates(acceptance_length: float, num_draft: int) -> np.ndarray:
    """vLLM's minimum-variance schedule: rate i = P(first i drafts all accepted). AL counts the bonus, so
    n = AL - 1 drafts on average: floor(n) ones, then frac(n), then zeros (AL=6, K=7 -> [1,1,1,1,1,0,0])."""
    if not 1.0 <= acceptance_length <= num_draft + 1:
        raise ValueError(f"acceptance_length must lie in [1, {num_draft + 1}], got {acceptance_length}")
    n = acceptance_length - 1.0
    whole = math.floor(n)
    rates = np.zeros(num_draft)
    rates[:whole] = 1.0
    if whole < num_draft:
        rates[whole] = n - whole
    return rates


def accept_synthetic(key, logits_BTV, drafts_BK, acceptance_length: float, sampling: float | SamplingParams):
    """Benchmark mode: acceptance ignores agreement; the target logits still pick the next token."""
    K = drafts_BK.shape[1]
    rates = synthetic_rates(acceptance_length, K)
    prev = np.concatenate([[1.0], rates[:-1]])
    cond = np.divide(rates, prev, out=np.zeros_like(rates), where=prev > 0)  # P(accept i | i-1 accepted)
    k_u, k_tok = jax.random.split(key)
    n_acc = _first_rejection(jax.random.uniform(k_u, drafts_BK.shape) < jnp.asarray(cond, jnp.float32))
    return n_acc, sampling_lib.sample(_row(logits_BTV, n_acc), k_tok, _sp(sampling)).astype(drafts_BK.dtype)


def accept(key, logits_BTV, drafts_BK, q_BKV, sampling: float | SamplingParams, acceptance_length=None):
    """Dispatch: synthetic when acceptance_length is set, greedy at temperature 0, else rejection sampling
    (a drafter without probabilities is a greedy drafter: q = one-hot of its drafts)."""
    sp = _sp(sampling)
    if acceptance_length is not None:
        return accept_synthetic(key, logits_BTV, drafts_BK, acceptance_length, sp)
    if sp.greedy:
        return accept_greedy(logits_BTV, drafts_BK)
    if q_BKV is None:
        q_BKV = jax.nn.one_hot(drafts_BK, logits_BTV.shape[-1], dtype=jnp.float32)
    return accept_rejection(key, logits_BTV, drafts_BK, q_BKV, sp)


# ---- 3. the generation loop ------------------------------------------------------------------------------


class SpecConfig(NamedTuple):
    """Everything static about a speculative run (hashable: the jit key)."""

    cfg: K3Config
    drafter: object  # a k3jax.drafter.Drafter (frozen dataclass)
    num_draft: int = 7
    max_new_tokens: int = 64
    sampling: SamplingParams = SamplingParams()  # the target's: temperature / top-k / top-p
    acceptance_length: float | None = None  # synthetic acceptance (benchmarks) when set
    dtype: object = jnp.bfloat16
    policy: DecodePolicy = XLA  # which kernels run (pallas_kernels.policy)
    stop_ids: tuple[int, ...] = ()  # a sequence is done once it emits any of these (e.g. EOS and <|im_end|>)
    cache_dtype: str = "bf16"  # the target's MLA cache: "bf16" (the compute dtype) or "fp8"
    mesh: Mesh | None = None  # tensor parallelism over its "tp" axis (params sharded as k3jax.sharding)

    @property
    def comm(self) -> Comm:
        return Comm(sh.AXIS if self.mesh is not None else None, self.policy)


class SpecState(NamedTuple):
    cache: dict
    draft_state: object
    anchor_B: jax.Array  # the last emitted token, not yet in the cache
    out_BN: jax.Array  # emitted tokens (N = max_new + K + 1 so a step never writes out of bounds)
    n_out_B: jax.Array
    done_B: jax.Array  # stop token emitted
    key: jax.Array
    step: jax.Array
    accepted_SB: jax.Array  # per step and sequence: accepted drafts (-1 once the sequence is finished)


def _is_stop(spec: SpecConfig, tokens):
    return jnp.isin(tokens, jnp.asarray(spec.stop_ids, jnp.int32)) if spec.stop_ids else jnp.zeros(tokens.shape, bool)


def _prefill(spec: SpecConfig, params, draft_params, prompt_BT, n_prompt_B, key, cache, dstate) -> SpecState:
    cfg, K, B = spec.cfg, spec.num_draft, prompt_BT.shape[0]
    logits, cache, taps = model.extend(
        params, prompt_BT, n_prompt_B, cache, cfg, spec.dtype, taps=spec.drafter.taps, comm=spec.comm
    )
    key, k_tok = jax.random.split(key)
    anchor = sampling_lib.sample(logits, k_tok, spec.sampling)
    dstate = spec.drafter.observe(
        draft_params, params, dstate, prompt_BT, n_prompt_B, jnp.zeros_like(n_prompt_B), taps, comm=spec.comm
    )
    out = jnp.zeros((B, spec.max_new_tokens + K + 1), jnp.int32).at[:, 0].set(anchor)
    done = _is_stop(spec, anchor)
    return SpecState(
        cache,
        dstate,
        anchor,
        out,
        jnp.ones((B,), jnp.int32),
        done,
        key,
        jnp.zeros((), jnp.int32),
        jnp.full((spec.max_new_tokens, B), -1, jnp.int32),
    )


def _step(spec: SpecConfig, params, draft_params, st: SpecState) -> SpecState:
    K, comm = spec.num_draft, spec.comm
    key, k_draft, k_acc = jax.random.split(st.key, 3)
    start_B = st.cache["lengths"]
    prop = spec.drafter.propose(
        draft_params, params, st.draft_state, st.anchor_B, start_B, K, k_draft, spec.sampling.temperature, comm=comm
    )
    drafts = prop.drafts_BK.astype(jnp.int32)
    block = jnp.concatenate([st.anchor_B[:, None], drafts], axis=1)
    logits, pending, taps = verify(params, block, st.cache, spec.cfg, spec.dtype, spec.drafter.taps, comm)
    n_acc, nxt = accept(k_acc, logits, drafts, prop.q_BKV, spec.sampling, spec.acceptance_length)
    active = (st.n_out_B < spec.max_new_tokens) & ~st.done_B
    n_commit = jnp.where(active, n_acc + 1, 0)
    cache = commit(pending, n_commit, spec.policy)
    dstate = spec.drafter.observe(draft_params, params, st.draft_state, block, n_commit, start_B, taps, comm=comm)

    i = jnp.arange(K + 1)[None]
    emitted = jnp.where(i < n_acc[:, None], jnp.concatenate([drafts, drafts[:, :1]], axis=1), nxt[:, None])
    keep = i < n_commit[:, None]
    b = jnp.arange(block.shape[0])[:, None]
    slot = jnp.where(keep, st.n_out_B[:, None] + i, st.out_BN.shape[1])  # out of range -> dropped
    out = st.out_BN.at[b, slot].set(emitted, mode="drop")
    done = st.done_B | jnp.any(keep & _is_stop(spec, emitted), axis=1)
    accepted = st.accepted_SB.at[st.step].set(jnp.where(active, n_acc, -1), mode="drop")
    return SpecState(
        cache, dstate, jnp.where(active, nxt, st.anchor_B), out, st.n_out_B + n_commit, done, key, st.step + 1, accepted
    )


def _running(spec: SpecConfig, st: SpecState):
    return jnp.any((st.n_out_B < spec.max_new_tokens) & ~st.done_B) & (st.step < spec.max_new_tokens)


def _loop(spec: SpecConfig, params, draft_params, st: SpecState) -> SpecState:
    return jax.lax.while_loop(lambda s: _running(spec, s), lambda s: _step(spec, params, draft_params, s), st)


def _state_specs(cache) -> SpecState:
    """KDA state/conv split by heads; everything else (MLA cache, drafter state, tokens, keys) replicated."""
    return SpecState(sh.cache_specs(cache), *([P()] * (len(SpecState._fields) - 1)))


def _draft_specs(spec: SpecConfig):
    """The drafter's weights on the mesh: as its param_specs(tp) says (DSpark: split as the target's), else
    replicated (the n-gram drafter has none)."""
    specs = getattr(spec.drafter, "param_specs", None)
    return P() if specs is None else specs(spec.mesh.shape[sh.AXIS])


def _on_mesh(spec: SpecConfig, body, params, state_specs, out_specs):
    """`body(params, draft_params, *state)` as is on one device, else under shard_map over "tp": params
    split as the tensor table says, the drafter's weights as _draft_specs says."""
    if spec.mesh is None:
        return body
    pspec = sh.param_specs(spec.cfg, experts_format(params))
    return jax.shard_map(
        body, mesh=spec.mesh, in_specs=(pspec, _draft_specs(spec), *state_specs), out_specs=out_specs, check_vma=False
    )


def prefill(spec: SpecConfig, params, draft_params, prompt_BT, n_prompt_B, key, max_len: int) -> SpecState:
    """Target prefill of right-padded prompts; the first generated token becomes the anchor."""
    B = prompt_BT.shape[0]
    cache = cache_lib.init_cache(spec.cfg, B, max_len, spec.dtype, spec.cache_dtype)  # global shapes
    dstate = spec.drafter.init_state(B, max_len, spec.dtype)
    cspec = sh.cache_specs(cache)
    run = _on_mesh(spec, partial(_prefill, spec), params, (P(), P(), P(), cspec, P()), _state_specs(cache))
    return run(params, draft_params, prompt_BT, n_prompt_B, key, cache, dstate)


def step(spec: SpecConfig, params, draft_params, st: SpecState) -> SpecState:
    """One draft -> verify -> accept -> commit round for the whole batch (finished sequences stay frozen)."""
    specs = _state_specs(st.cache)
    return _on_mesh(spec, partial(_step, spec), params, (specs,), specs)(params, draft_params, st)


def loop(spec: SpecConfig, params, draft_params, st: SpecState) -> SpecState:
    """All steps on device (one dispatch for the whole generation)."""
    specs = _state_specs(st.cache)
    return _on_mesh(spec, partial(_loop, spec), params, (specs,), specs)(params, draft_params, st)


prefill_jit = jax.jit(prefill, static_argnums=(0, 6))
step_jit = jax.jit(step, static_argnums=0, donate_argnums=3)  # the verify step, for benchmarks to time
loop_jit = jax.jit(loop, static_argnums=0, donate_argnums=3)


def stats(st: SpecState, num_draft: int | None = None) -> dict:
    """Host-side acceptance statistics (accepted drafts per step; acceptance length counts the bonus).
    With num_draft: per-position acceptance rates, rate i = fraction of live (sequence, step) pairs that
    accepted draft i (hence drafts 1..i), the quantity synthetic acceptance fixes."""
    acc = np.asarray(st.accepted_SB)[: int(st.step)]
    live = acc[acc >= 0]
    K1 = None if live.size == 0 else float(np.mean(live + 1))
    out = {
        "steps": int(st.step),
        "accepted_per_step": acc,
        "mean_acceptance_length": K1,
        "tokens_generated": np.asarray(st.n_out_B),
    }
    if num_draft is not None:
        out["position_acceptance_rates"] = (
            [float(np.mean(live >= i)) for i in range(1, num_draft + 1)] if live.size else None
        )
    return out


def generate(
    params,
    cfg: K3Config,
    prompt_BT,
    n_prompt_B,
    *,
    drafter,
    draft_params=None,
    num_draft: int = 7,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    acceptance_length: float | None = None,
    seed: int = 0,
    dtype=jnp.bfloat16,
    policy: DecodePolicy | str = XLA,
    stop_ids=(),
    cache_dtype: str = "bf16",
    max_len: int | None = None,
    on_device_loop: bool = True,
    on_step=None,
    mesh: Mesh | None = None,
):
    """Speculative generation for a right-padded prompt batch. Returns (tokens [B, max_new_tokens], stats).

    mesh: tensor parallelism over its "tp" axis; `params` should already be placed with
    k3jax.sharding.param_shardings (otherwise every call reshards them).

    on_device_loop: one jitted while_loop; otherwise a host loop over `step_jit`, calling on_step(i, state)
    after each step (benchmarks hook their timing there). A sequence stops once it emits any of stop_ids;
    tokens after that are not meaningful.
    """
    sp = SamplingParams(temperature=float(temperature), top_k=top_k, top_p=top_p)
    if mesh is not None:
        sh.validate_tp(cfg, mesh.shape[sh.AXIS])
    spec = SpecConfig(
        cfg,
        drafter,
        num_draft,
        max_new_tokens,
        sp,
        acceptance_length,
        dtype,
        as_policy(policy),
        tuple(int(t) for t in stop_ids),
        cache_dtype,
        mesh,
    )
    prompt_BT = jnp.asarray(prompt_BT, jnp.int32)
    n_prompt_B = jnp.asarray(n_prompt_B, jnp.int32)
    max_len = max_len or prompt_BT.shape[1] + max_new_tokens + num_draft + 1
    st = prefill_jit(spec, params, draft_params, prompt_BT, n_prompt_B, jax.random.key(seed), max_len)
    if on_device_loop:
        st = loop_jit(spec, params, draft_params, st)
    else:
        while bool(_running(spec, st)):
            st = step_jit(spec, params, draft_params, st)
            if on_step is not None:
                on_step(int(st.step), st)
    return st.out_BN[:, :max_new_tokens], stats(st, num_draft)


speculative_generate = generate  # the name bench/decode.py imports
