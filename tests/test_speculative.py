"""Speculative decoding: verify + accept + commit reproduce plain greedy decoding exactly; rejection sampling
is lossless (statistical test); synthetic acceptance follows vLLM's minimum-variance schedule."""

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import near_tie

from k3jax import cache as cache_lib
from k3jax import model, speculative
from k3jax.config import preset
from k3jax.drafter import NgramDrafter, Proposal
from k3jax.params import cast_params, init_params
from k3jax.sampling import SamplingParams

F32 = jnp.float32


@pytest.fixture(scope="module")
def tiny():
    # tiny cut to 4 layers (KDA dense, MLA, KDA, MLA; AttnRes boundaries at 0 and 3): compiles fast
    cfg = preset("tiny").replace(num_hidden_layers=4, full_attn_layers=(2, 4))
    seed = int(np.random.default_rng().integers(1 << 30))
    return cfg, cast_params(jax.jit(lambda: init_params(cfg, seed))(), F32)  # one compile, not one per tensor


@dataclass(frozen=True)
class TableDrafter:
    """Test drafter: each draft is the true next token (from a reference sequence) with probability
    draft_params['p_right'], else a wrong token. p_right = 1: all right, 0: all wrong (adversarial)."""

    vocab: int
    taps: tuple = ()

    def init_state(self, batch, max_len, dtype):
        return ()

    def observe(self, draft_params, target_params, state, tokens_BT, n_B, start_B, taps, comm=None):
        return state

    def propose(self, draft_params, target_params, state, anchor_B, pos_B, num_draft, key, temperature, comm=None):
        ref = draft_params["ref"]
        idx = jnp.minimum(pos_B[:, None] + 1 + jnp.arange(num_draft)[None], ref.shape[1] - 1)
        right = jnp.take_along_axis(ref, idx, axis=1)
        k1, k2 = jax.random.split(key)
        wrong = (right + jax.random.randint(k1, right.shape, 1, self.vocab)) % self.vocab
        pick_right = jax.random.uniform(k2, right.shape) < draft_params["p_right"]
        return Proposal(jnp.where(pick_right, right, wrong))


def ragged_prompts(rng, cfg, B):
    n = rng.integers(2, 12, size=B)
    n[rng.integers(B)] = 12  # one full row
    prompt = np.full((B, 12), cfg.pad_token_id, np.int32)
    for b in range(B):
        prompt[b, : n[b]] = rng.integers(0, cfg.vocab_size, size=n[b])
    return prompt, n.astype(np.int32)


_extend = jax.jit(model.extend, static_argnames=("cfg", "dtype"))


def baseline_greedy(params, cfg, prompt, n_prompt, max_new):
    """Plain greedy decoding with model.extend: ragged prefill, then T=1 steps. -> (tokens [B, max_new], sure
    [B]: how many leading tokens of each row are clear argmaxes, i.e. precede its first near-tie). Verify scores
    K + 1 tokens in one extend: the same maths in another fp32 order, so it may part from this at a near-tie."""
    B = prompt.shape[0]
    cache = cache_lib.init_cache(cfg, B, prompt.shape[1] + max_new + 1, F32, "bf16")
    logits, cache, _ = _extend(params, jnp.asarray(prompt), jnp.asarray(n_prompt), cache, cfg=cfg, dtype=F32)
    toks, tie = [jnp.argmax(logits, -1).astype(jnp.int32)], [near_tie(logits)]
    for _ in range(max_new - 1):
        one = jnp.ones((B,), jnp.int32)
        logits, cache, _ = _extend(params, toks[-1][:, None], one, cache, cfg=cfg, dtype=F32)
        toks.append(jnp.argmax(logits, -1).astype(jnp.int32))
        tie.append(near_tie(logits))
    tie = np.stack(tie, axis=1)
    sure = np.where(tie.any(1), tie.argmax(1), max_new)
    if np.any(sure < max_new):
        print(f"near-tie: comparing only the first {sure.tolist()} tokens")
    return np.stack([np.asarray(t) for t in toks], axis=1), sure


def assert_same_greedy(got, want, sure):
    for b, n in enumerate(sure):
        np.testing.assert_array_equal(np.asarray(got)[b, :n], want[b, :n], err_msg=f"row {b}")


def test_greedy_speculative_equals_greedy(tiny, rng):
    cfg, params = tiny
    B, K, max_new = 3, 4, 14
    prompt, n_prompt = ragged_prompts(rng, cfg, B)
    want, sure = baseline_greedy(params, cfg, prompt, n_prompt, max_new)
    ref = np.zeros((B, prompt.shape[1] + max_new + K + 2), np.int32)  # the true token at every position
    for b in range(B):
        seq = np.concatenate([prompt[b, : n_prompt[b]], want[b]])
        ref[b, : len(seq)] = seq
    drafter = TableDrafter(cfg.vocab_size)
    for p_right in (0.0, 1.0, 0.6):  # adversarial all-wrong, all-right, random mix
        dp = {"ref": jnp.asarray(ref), "p_right": jnp.float32(p_right)}
        got, st = speculative.generate(
            params,
            cfg,
            prompt,
            n_prompt,
            drafter=drafter,
            num_draft=K,
            draft_params=dp,
            max_new_tokens=max_new,
            dtype=F32,
            seed=int(rng.integers(1 << 30)),
        )
        acc = st["accepted_per_step"]
        print(f"p_right={p_right}: steps={st['steps']} accepted={acc.tolist()}")
        assert_same_greedy(got, want, sure)
        live = acc[acc >= 0]
        if np.any(sure < max_new):  # past a near-tie the table's "true" tokens need not be the model's
            continue
        if p_right == 0.0:
            assert np.all(live == 0) and st["steps"] == max_new - 1
        if p_right == 1.0:
            assert np.all(acc[:-1][acc[:-1] >= 0] == K)  # every draft accepted until the last step
        if p_right == 0.6:
            assert 0 < live.mean() < K


def test_any_stop_id_ends_a_sequence(tiny, rng):
    """stop_ids holds several ids (EOS and end-of-turn in a chat model): a row is done at its first emission of
    any of them. All drafts wrong, so each step emits one token and tokens_generated counts exactly."""
    cfg, params = tiny
    B, K, max_new = 2, 3, 14
    prompt, n_prompt = ragged_prompts(rng, cfg, B)
    want, sure = baseline_greedy(params, cfg, prompt, n_prompt, max_new)
    if sure.min() < 4:
        pytest.skip(f"near-tie within the first tokens (sure={sure.tolist()}): no trustworthy stop position")
    stop = (int(want[1, rng.integers(1, sure.min())]), int(want[0, rng.integers(1, sure.min())]))
    ref = np.zeros((B, prompt.shape[1] + max_new + K + 2), np.int32)
    dp = {"ref": jnp.asarray(ref), "p_right": jnp.float32(0.0)}
    got, st = speculative.generate(
        params,
        cfg,
        prompt,
        n_prompt,
        drafter=TableDrafter(cfg.vocab_size),
        num_draft=K,
        draft_params=dp,
        max_new_tokens=max_new,
        dtype=F32,
        stop_ids=stop,
    )
    for b in range(B):
        first = next(i for i, t in enumerate(want[b]) if t in stop)  # <= the drawn position, so < sure
        assert st["tokens_generated"][b] == first + 1, (b, stop, want[b].tolist())
        np.testing.assert_array_equal(np.asarray(got)[b, : first + 1], want[b, : first + 1])


def test_ngram_drafter_host_loop(tiny, rng):
    """A real drafter through the host loop (the benchmark path): output still equals greedy decoding."""
    cfg, params = tiny
    B, K, max_new = 3, 3, 14  # same B and max_new as above: the baseline's compiled steps are reused
    prompt, n_prompt = ragged_prompts(rng, cfg, B)
    prompt[:, 6:12] = prompt[:, 0:6]  # repeats so that lookups hit sometimes
    want, sure = baseline_greedy(params, cfg, prompt, n_prompt, max_new)
    seen = []
    got, st = speculative.generate(
        params,
        cfg,
        prompt,
        n_prompt,
        drafter=NgramDrafter(),
        num_draft=K,
        max_new_tokens=max_new,
        dtype=F32,
        on_device_loop=False,
        on_step=lambda i, s: seen.append(i),
    )
    assert_same_greedy(got, want, sure)
    assert seen == list(range(1, st["steps"] + 1))


def test_ngram_lookup(rng):
    V = 50
    hist = rng.integers(0, V, size=(1, 20)).astype(np.int32)
    hist[0, 10:13] = hist[0, 3:6]  # ... a b c (at 3..5) ... a b [anchor c at 12]
    d = NgramDrafter(max_ngram=3)
    state = d.observe(
        None, None, d.init_state(1, 32, F32), jnp.asarray(hist[:, :12]), jnp.array([12]), jnp.array([0]), {}
    )
    prop = d.propose(None, None, state, jnp.asarray(hist[:, 12]), jnp.array([12]), 4, None, 0.0)
    np.testing.assert_array_equal(np.asarray(prop.drafts_BK)[0], hist[0, 6:10])


# ---- acceptance -------------------------------------------------------------------------------------------


def test_accept_greedy(rng):
    B, K, V = 64, 5, 7
    logits = rng.standard_normal((B, K + 1, V)).astype(np.float32)
    target = logits.argmax(-1)
    drafts = np.where(rng.random((B, K)) < 0.7, target[:, :K], (target[:, :K] + 1) % V)
    n, nxt = speculative.accept_greedy(jnp.asarray(logits), jnp.asarray(drafts, jnp.int32))
    for b in range(B):
        want = next((i for i in range(K) if drafts[b, i] != target[b, i]), K)
        assert int(n[b]) == want and int(nxt[b]) == target[b, want]


def _lossy(key, logits, drafts, q, temperature=1.0):
    """A deliberately wrong sampler (on rejection, resample from p instead of the residual)."""
    n, _ = speculative.accept_rejection(key, logits, drafts, q, temperature)
    return n, jax.random.categorical(key, logits[jnp.arange(len(n)), n])


def _simulate(key, P, Q, K, N, M, sampler):
    """Draft-and-verify rounds with position-dependent, context-free target P[t] and draft Q[t] until every
    one of N streams has M tokens. Returns the first M tokens of every stream [N, M]."""
    out = np.full((N, M + K + 1), -1)
    n = np.zeros(N, int)
    logP = np.log(np.maximum(P, 1e-30))
    while n.min() < M:
        key, kd, ka = jax.random.split(key, 3)
        rows = np.minimum(n[:, None] + np.arange(K + 1)[None], len(P) - 1)
        q = jnp.asarray(Q[rows[:, :K]])  # [N, K, V]
        drafts = jax.random.categorical(kd, jnp.log(q), axis=-1)
        nacc, nxt = sampler(ka, jnp.asarray(logP[rows]), drafts, q)
        nacc, nxt, drafts = np.asarray(nacc), np.asarray(nxt), np.asarray(drafts)
        for i in range(K + 1):
            tok = np.where(i < nacc, drafts[:, min(i, K - 1)], nxt)
            w = (i <= nacc) & (n < M)
            out[w, n[w] + i] = tok[w]
        n = np.where(n < M, n + nacc + 1, n)
    return out[:, :M]


def _chi2_bound(dof, z=4.75):  # Wilson-Hilferty upper quantile at about p = 1e-6
    return dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("top_k", [0, 3])
def test_rejection_sampling_is_lossless(rng, top_k):
    """The emitted stream must be distributed exactly as plain sampling from the target: joint of the first
    two tokens against P[0] x P[1] (chi-square), for arbitrary q (including zeros where p is not, and vice
    versa); with top_k, P is the temperature-scaled, top-k-filtered target."""
    V, K, N, M = 6, 3, 60000, 2
    P = rng.dirichlet(np.ones(V), size=M + K + 1)
    Q = rng.dirichlet(np.ones(V) * 0.5, size=M + K + 1)
    P[:, 0], Q[:, 1] = 0.0, 0.0  # the target never emits 0; the draft never proposes 1
    P /= P.sum(1, keepdims=True)
    Q /= Q.sum(1, keepdims=True)
    sp = SamplingParams(temperature=0.7 if top_k else 1.0, top_k=top_k)
    sampler = functools.partial(speculative.accept_rejection, sampling=sp)
    want = P ** (1 / sp.temperature)
    if top_k:
        want[want < np.sort(want, axis=1)[:, -top_k : -top_k + 1]] = 0.0
    want /= want.sum(1, keepdims=True)
    expect = N * np.outer(want[0], want[1]).reshape(-1)
    cells = expect > 0

    def chi2(toks):
        counts = np.bincount(toks[:, 0] * V + toks[:, 1], minlength=V * V)
        assert counts[~cells].sum() == 0, "emitted a token the target gives probability 0"
        return float(np.sum((counts[cells] - expect[cells]) ** 2 / expect[cells]))

    bound = _chi2_bound(int(cells.sum()) - 1)
    good = chi2(_simulate(jax.random.key(1234), P, Q, K, N, M, sampler))
    print(f"chi2 = {good:.1f} (bound {bound:.1f})")
    assert good < bound
    with pytest.raises(AssertionError):  # the same test rejects a lossy sampler
        assert chi2(_simulate(jax.random.key(1234), P, Q, K, N, M, _lossy)) < bound


# ---- synthetic acceptance ---------------------------------------------------------------------------------


def test_synthetic_rates():
    np.testing.assert_allclose(speculative.synthetic_rates(6, 7), [1, 1, 1, 1, 1, 0, 0])
    np.testing.assert_allclose(speculative.synthetic_rates(3.51, 5), [1, 1, 0.51, 0, 0], atol=1e-12)
    np.testing.assert_allclose(speculative.synthetic_rates(8, 7), np.ones(7))
    np.testing.assert_allclose(speculative.synthetic_rates(1, 3), np.zeros(3))
    with pytest.raises(ValueError):
        speculative.synthetic_rates(9, 7)


def test_synthetic_acceptance_statistics(rng):
    B, K, V = 20000, 5, 11
    logits = jnp.asarray(rng.standard_normal((B, K + 1, V)), F32)
    drafts = jnp.asarray(rng.integers(0, V, size=(B, K)), jnp.int32)
    n, nxt = speculative.accept_synthetic(jax.random.key(7), logits, drafts, 6.0, 0.0)
    assert np.all(np.asarray(n) == 5) and np.all(np.asarray(nxt) == np.asarray(logits[:, K]).argmax(-1))
    n, _ = speculative.accept_synthetic(jax.random.key(7), logits, drafts, 3.4, 0.0)
    counts = np.bincount(np.asarray(n), minlength=K + 1) / B
    np.testing.assert_allclose(counts, [0, 0, 0.6, 0.4, 0, 0], atol=0.02)  # mean length 1 + 2.4 = 3.4


def test_synthetic_generate(tiny, rng):
    """Benchmark mode runs the real verify and commits exactly AL-1 drafts + 1 per step."""
    cfg, params = tiny
    prompt, n_prompt = ragged_prompts(rng, cfg, 2)
    _, st = speculative.generate(
        params,
        cfg,
        prompt,
        n_prompt,
        drafter=NgramDrafter(),
        num_draft=7,
        max_new_tokens=13,
        acceptance_length=6.0,
        dtype=F32,
    )
    acc = st["accepted_per_step"]
    assert st["steps"] == 2 and np.all(acc == 5) and st["mean_acceptance_length"] == 6.0
