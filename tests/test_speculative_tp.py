"""Speculative decoding under tensor parallelism on fake CPU devices: greedy speculative generation with the
DSpark drafter at TP 1, 2 and 4 gives exactly the tokens of plain one-device greedy decoding, and the
drafter's proposals (which read the vocab-split target embedding and lm_head) do not depend on the TP size."""

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import multihost_worker as worker
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from convert.fake_dspark import tiny_dspark_config
from k3jax import drafter_params as DP
from k3jax import params as params_lib
from k3jax import sharding as sh
from k3jax import speculative
from k3jax.comm import LOCAL, Comm
from k3jax.drafter import DSparkDrafter, Proposal, dspark_block
from k3jax.engine import Engine

F32 = jnp.float32
K, MAX_NEW = 3, 10


@dataclass(frozen=True)
class OracleMixDrafter:
    """DSpark proposes (through its TP path); each draft is then replaced by the true next token with
    probability p_right, so steps accept some drafts and reject others (random DSpark weights rarely agree
    with the random target on their own)."""

    dspark: DSparkDrafter

    @property
    def taps(self):
        return self.dspark.taps

    def init_state(self, batch, max_len, dtype):
        return self.dspark.init_state(batch, max_len, dtype)

    def param_specs(self, tp):  # DSpark's weights split as in serving; the oracle's inputs whole
        return {"dspark": self.dspark.param_specs(tp), "ref": P(), "p_right": P()}

    def observe(self, dp, target_params, state, tokens_BT, n_B, start_B, taps, comm=None):
        return self.dspark.observe(dp["dspark"], target_params, state, tokens_BT, n_B, start_B, taps, comm=comm)

    def propose(self, dp, target_params, state, anchor_B, pos_B, num_draft, key, temperature, comm=None):
        k_draft, k_mix = jax.random.split(key)
        prop = self.dspark.propose(
            dp["dspark"], target_params, state, anchor_B, pos_B, num_draft, k_draft, temperature, comm=comm
        )
        ref = dp["ref"]
        right = jnp.take_along_axis(
            ref, jnp.minimum(pos_B[:, None] + 1 + jnp.arange(num_draft), ref.shape[1] - 1), axis=1
        )
        pick = jax.random.uniform(k_mix, right.shape) < dp["p_right"]
        return Proposal(jnp.where(pick, right, prop.drafts_BK))


@pytest.fixture(scope="module")
def setup():
    seed = int.from_bytes(np.random.bytes(4), "little")
    print(f"speculative tp seed {seed}")
    cfg = worker.demo4_config()  # demo widths (every TP size up to 16), 4 layers: KDA dense, KDA MoE x2, MLA MoE
    params_np = worker.numpy_params(cfg, seed)
    c = tiny_dspark_config(cfg, num_taps=2)
    rng = np.random.default_rng(seed)
    dspark_np = params_lib.unflatten({s.path: worker.draw(s, rng).astype(np.float32) for s in DP.tensor_table(c)})
    prompts = worker.prompts_for(seed, cfg.vocab_size)  # lengths 5 and 9: ragged
    eng = Engine(
        cfg,
        jax.tree.map(jnp.asarray, params_np),
        max_len=32,
        max_batch=2,
        dtype=F32,
        cache_dtype="bf16",
        steps_per_call=MAX_NEW - 1,
    )
    want = np.array(eng.generate(prompts, max_new_tokens=MAX_NEW, stop_ids=[-1]).tokens)  # plain greedy, TP1
    return cfg, params_np, c, dspark_np, prompts, want


def _place(cfg, params_np, tp):
    mesh = sh.make_mesh(tp)
    return mesh, worker.place(params_np, sh.param_shardings(cfg, mesh))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_greedy_speculative_tp_equals_greedy(setup, tp):
    cfg, params_np, c, dspark_np, prompts, want = setup
    mesh, params = _place(cfg, params_np, tp)
    B, S = len(prompts), max(map(len, prompts))
    prompt = np.full((B, S), cfg.pad_token_id, np.int32)
    ref = np.zeros((B, S + MAX_NEW + K + 2), np.int32)  # the true token at every position
    for b, p in enumerate(prompts):
        prompt[b, : len(p)] = p
        ref[b, : len(p) + MAX_NEW] = np.concatenate([p, want[b]])
    dp = {"dspark": jax.tree.map(jnp.asarray, dspark_np), "ref": jnp.asarray(ref), "p_right": jnp.float32(0.6)}
    got, st = speculative.generate(
        params,
        cfg,
        prompt,
        [len(p) for p in prompts],
        drafter=OracleMixDrafter(DSparkDrafter(c)),
        draft_params=dp,
        num_draft=K,
        max_new_tokens=MAX_NEW,
        dtype=F32,
        mesh=mesh,
        seed=tp,
    )
    acc = st["accepted_per_step"]
    print(f"tp={tp}: steps={st['steps']} accepted={acc.tolist()}")
    np.testing.assert_array_equal(np.asarray(got), want)
    live = acc[acc >= 0]
    assert 0 < live.mean() < K  # both commit paths: accepted drafts and rejections
    rates = st["position_acceptance_rates"]
    assert rates == sorted(rates, reverse=True) and rates[0] == np.mean(live >= 1)


@pytest.mark.parametrize("split_drafter", [False, True])
def test_dspark_propose_independent_of_tp(setup, rng, split_drafter):
    """Drafts and base draft logits read through the vocab-split target embedding and lm_head at TP 4, with
    the drafter's own layers whole on every rank or split by heads and FFN intermediate (param_specs: its
    all-reduces), equal the one-device ones (the speculative test above is lossless whatever the drafts, so it
    cannot see this)."""
    cfg, params_np, c, dspark_np, *_ = setup
    drafter, B, T, max_len = DSparkDrafter(c), 2, 6, 16
    dp = jax.tree.map(jnp.asarray, dspark_np)
    taps = {L: jnp.asarray(rng.standard_normal((B, T, cfg.hidden_size)), F32) for L in drafter.taps}
    n_B = jnp.asarray([T, int(rng.integers(1, T))], jnp.int32)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    state = drafter.observe(dp, None, drafter.init_state(B, max_len, F32), tokens, n_B, jnp.zeros(B, jnp.int32), taps)
    anchor = jnp.asarray(rng.integers(0, cfg.vocab_size, B), jnp.int32)

    def draft(dp, params, comm=LOCAL):  # -> (drafts [B,K], base logits U [B,K,V])
        U = dspark_block(dp, params, state["rows"], n_B, anchor, n_B, K, c, F32, comm)[1]
        return drafter.propose(dp, params, state, anchor, n_B, K, None, 0.0, comm=comm).drafts_BK, U

    want_drafts, want_U = jax.jit(draft)(dp, jax.tree.map(jnp.asarray, params_np))
    mesh, params = _place(cfg, params_np, 4)
    comm = Comm(sh.AXIS)
    sharded = jax.shard_map(
        partial(draft, comm=comm),
        mesh=mesh,
        in_specs=(drafter.param_specs(4) if split_drafter else P(), sh.param_specs(cfg)),
        out_specs=P(),
        check_vma=False,
    )
    got_drafts, got_U = jax.jit(sharded)(dp, params)
    assert (comm.counts["draft_attn"] > 0) == split_drafter and (comm.counts["draft_ffn"] > 0) == split_drafter
    np.testing.assert_allclose(np.asarray(got_U), np.asarray(want_U), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got_drafts), np.asarray(want_drafts))


def test_dspark_heads_not_dividing_tp_refused(setup, rng):
    """The drafter's layers split over tp as the target's: a head count or intermediate tp does not divide is
    refused with what to do (k3jax.generate checks it before loading anything)."""
    cfg = setup[0]
    heads = int(rng.choice([3, 5]))
    with pytest.raises(ValueError, match=f"num_attention_heads = {heads} does not divide by tp = 2; use a tp"):
        DP.check_tp(tiny_dspark_config(cfg, heads=heads), 2)
    c = tiny_dspark_config(cfg, heads=4, intermediate_size=6)
    with pytest.raises(ValueError, match="intermediate_size = 6 does not divide by tp = 4"):
        DP.param_specs(c, 4)
    specs = DP.param_specs(c, 2)  # 4 heads and 6 of intermediate split in two: the layers split, the rest whole
    assert specs["layers"][0]["attn"]["o"] == P(None, sh.AXIS, None) and specs["markov_w2"] == P(None, None)
