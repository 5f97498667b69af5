"""Tensor parallelism on 16 fake CPU devices: every valid TP size gives the one-device logits and tokens, the
collectives are exactly the planned ones per layer, bad TP sizes are refused, and the planner's bytes per
rank agree with docs/roofline.md §1."""

from functools import partial

import jax
import jax.numpy as jnp
import multihost_worker as worker
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k3jax import cache as cache_lib
from k3jax import model
from k3jax import params as params_lib
from k3jax import sharding as sh
from k3jax.comm import Comm
from k3jax.config import preset
from k3jax.engine import Engine

F32 = jnp.float32
# TP changes only the fp32 summation order (split matmuls, psums of partial sums). Max |error| over the largest
# |logit|, TP 2..16 against one device, demo4 forward over 40 seeds: median 2.4e-6, worst 6.6e-6 (TP 4 and 8),
# and the engine's prefill + 3 decode steps (worst step of 8 seeds) median 2.5e-6, worst 4.8e-6: too close to
# the former 1e-5 for tests with several TP sizes and fresh seeds. 2e-5 is still far below what a
# collective or layout bug does (a missing or doubled all-reduce, a shard in the wrong place: 1e-2 and up).
TOL = 2e-5


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def setup():
    seed = int.from_bytes(np.random.bytes(4), "little")
    print(f"sharding seed {seed}")
    cfg = worker.demo4_config()
    rng = np.random.default_rng(seed)
    params_np = worker.numpy_params(cfg, seed)
    tokens = rng.integers(0, cfg.vocab_size, (2, 11)).astype(np.int32)
    ref = jax.jit(partial(model.forward, cfg=cfg, dtype=F32))(jax.tree.map(jnp.asarray, params_np), tokens)
    return cfg, params_np, tokens, np.asarray(ref), seed


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_forward_matches_one_device(setup, tp):
    cfg, params_np, tokens, ref, _ = setup
    mesh = sh.make_mesh(tp)
    params = worker.place(params_np, sh.param_shardings(cfg, mesh))
    fwd = jax.shard_map(
        partial(model.forward, cfg=cfg, dtype=F32, comm=Comm(sh.AXIS)),
        mesh=mesh,
        in_specs=(sh.param_specs(cfg), P()),
        out_specs=P(),
        check_vma=False,
    )
    got = jax.jit(fwd)(params, tokens)
    assert rel_err(got, ref) <= TOL


def _engine(cfg, params_np, tp, backend="auto"):
    mesh = sh.make_mesh(tp) if tp else None
    params = worker.place(params_np, sh.param_shardings(cfg, mesh)) if tp else jax.tree.map(jnp.asarray, params_np)
    return Engine(
        cfg,
        params,
        max_len=32,
        max_batch=2,
        dtype=F32,
        cache_dtype="bf16",
        mesh=mesh,
        steps_per_call=4,
        backend=backend,
    )


@pytest.fixture(scope="module")
def engine_ref(setup):
    """One-device prefill logits, 3 decode-step logits (fed fixed tokens) and greedy tokens."""
    cfg, params_np, _, _, seed = setup
    prompts = worker.prompts_for(seed, cfg.vocab_size)
    feed = np.random.default_rng(seed).integers(0, cfg.vocab_size, (3, 2)).astype(np.int32)
    return prompts, feed, _prefill_decode(_engine(cfg, params_np, 0), prompts, feed)


def _prefill_decode(eng, prompts, feed):
    logits, cache = eng.prefill(eng.new_cache(len(prompts)), prompts)
    out = [np.asarray(logits)]
    for tok in feed:  # T == 1 through the engine's (sharded) extend: the decode path
        logits, cache = eng.step(tok[:, None], np.ones(len(prompts)), cache)
        out.append(np.asarray(logits))
    tokens = eng.generate(prompts, max_new_tokens=5, stop_ids=[-1]).tokens
    return out, tokens


@pytest.mark.parametrize("tp, backend", [(1, "auto"), (4, "auto"), (16, "auto"), (4, "latency_specialized")])
def test_engine_matches_one_device(setup, engine_ref, tp, backend):
    """latency_specialized on CPU: the Pallas ops' fallbacks (the layer-boundary join's fp32 psum among them)."""
    cfg, params_np, *_ = setup
    prompts, feed, (want_logits, want_tokens) = engine_ref
    got_logits, got_tokens = _prefill_decode(_engine(cfg, params_np, tp, backend), prompts, feed)
    for step, (g, w) in enumerate(zip(got_logits, want_logits, strict=True)):
        assert rel_err(g, w) <= TOL, f"step {step}"
    assert got_tokens == want_tokens


def expected_collectives(cfg) -> dict:
    """The plan (k3jax.comm): per attention layer one all-reduce after o_proj; per dense FFN one all-reduce;
    per MoE layer one gather of the router's scores and latent_down's z, the latent-sum all-reduce and the
    output all-reduce;
    plus the embedding all-reduce and the logits gather."""
    kinds = cfg.layer_kinds
    n_moe = sum(k.endswith("_moe") for k in kinds)
    return {
        "embed": 1,
        "attn_out": len(kinds),
        "mlp_out": len(kinds) - n_moe,
        "routing": n_moe,
        "latent_sum": n_moe,
        "moe_out": n_moe,
        "logits": 1,
    }


@pytest.mark.parametrize("name, backend", [("demo", "auto"), ("demo4", "auto"), ("demo4", "latency_specialized")])
def test_collectives_per_decode_step(name, backend):
    cfg = preset("demo") if name == "demo" else worker.demo4_config()
    mesh = sh.make_mesh(4)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, F32 if a.dtype == jnp.bfloat16 else a.dtype, sharding=s),
        params_lib.abstract_params(cfg),
        sh.param_shardings(cfg, mesh),
    )
    eng = Engine(cfg, abstract, max_len=16, max_batch=2, dtype=F32, cache_dtype="bf16", mesh=mesh, backend=backend)
    cache = jax.eval_shape(lambda: cache_lib.init_cache(cfg, 2, 16, F32, "bf16"))
    hlo = jax.jit(eng.step_fn).lower(abstract, jnp.zeros((2, 1), jnp.int32), jnp.ones(2, jnp.int32), cache).as_text()
    want = expected_collectives(cfg)
    assert dict(eng.comm.counts) == want
    # and nothing else communicates: the lowered program holds exactly these collectives
    gathers = want["routing"] + want["logits"]
    assert hlo.count("stablehlo.all_gather") == gathers
    assert hlo.count("stablehlo.all_reduce") == sum(want.values()) - gathers
    assert "all_to_all" not in hlo and "collective_permute" not in hlo


def test_refusals():
    demo = preset("demo")
    assert sh.valid_tp_sizes(demo, 64) == [1, 2, 4, 8, 16]
    for tp in (3, 5, 32, 0):
        with pytest.raises(sh.ShardingError, match=r"Valid sizes: \[1, 2, 4, 8, 16"):
            sh.validate_tp(demo, tp)
    assert sh.valid_tp_sizes(preset("tiny"), 64) == [1]
    with pytest.raises(sh.ShardingError, match=r"Valid sizes: \[1\]"):
        sh.validate_tp(preset("tiny"), 2)
    with pytest.raises(sh.ShardingError, match="needs 32 devices but only 16"):
        sh.make_mesh(32)
    bad = jax.sharding.Mesh(np.array(jax.devices()[:3]), (sh.AXIS,))
    with pytest.raises(sh.ShardingError, match="tensor-parallel size 3"):
        Engine(demo, {"layers": []}, mesh=bad)
    with pytest.raises(sh.ShardingError):
        sh.param_shardings(demo, bad)


# docs/roofline.md §1: ~136.9 GB of weights read per decoded token (batch 1, whole model), "per rank" assuming every
# matrix split over tp (8.56 GB at TP16). Our layout replicates the small MLA q_a/kv_a (+ norms), KDA f_a and
# o_norm, and the norms / AttnRes vectors, so a rank reads those whole: at TP16 that adds ~0.81 GB (9.37 GB
# per rank). The test removes exactly that replicated surplus, computed from the tensor table, and compares.
ROOFLINE_ACTIVE = 136.9e9


def _replicated_surplus(cfg, tp):
    rep = [s for s in params_lib.tensor_table(cfg) if not any(sh.RULES.get(a) for a in s.axes if a)]
    names = {s.path[-1] for s in rep if s.nbytes > 1e6}
    assert names == {"q_a", "kv_a", "f_a"}, names  # the only large replicated tensors, by design
    return sum(s.nbytes * s.active for s in rep) * (1 - 1 / tp)


@pytest.mark.parametrize("tp", [8, 16])
def test_planner_agrees_with_roofline(tp):
    cfg = preset("k3")
    active = sh.active_bytes_per_device(cfg, tp)
    surplus = _replicated_surplus(cfg, tp)
    assert abs((active - surplus) / (ROOFLINE_ACTIVE / tp) - 1) < 0.03
    assert 0.07 < surplus / active < 0.10 if tp == 16 else 0.03 < surplus / active < 0.06
    whole = sh.bytes_per_device(cfg, tp)
    total = params_lib.param_counts(cfg)["bytes"]
    assert total / tp < whole < total / tp * 1.02  # the replicated tensors are < 2% of a rank's slice
    if tp == 16:
        assert 9.2e9 < active < 9.5e9
        assert 97e9 <= whole <= 99e9  # docs/roofline.md §1: ~97 GB of weights on each of the 16 ranks
