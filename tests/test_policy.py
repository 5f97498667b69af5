"""The decode policy (pallas_kernels/policy.py): one frozen, hashable object decides every kernel-or-XLA choice,
dispatch records what ran and why, and nothing on the hot path reads an environment variable."""

import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fixtures_demo import tiny_ckpt  # noqa: F401  (session fixture)

from pallas_kernels import common, policy
from pallas_kernels.gemv import api as gemv_api
from pallas_kernels.policy import SPECIALIZED, XLA, DecodePolicy, DispatchLog, Tuning

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_policy_is_frozen_hashable_and_normalised():
    assert DecodePolicy("xla") == DecodePolicy("auto") == XLA  # one name for stock XLA
    assert hash(DecodePolicy("latency_specialized")) == hash(SPECIALIZED)
    assert len({XLA, SPECIALIZED, DecodePolicy(moe_impl="gather")}) == 3
    with pytest.raises(AttributeError):
        XLA.backend = "latency_specialized"
    assert SPECIALIZED.kernels and not XLA.kernels
    # static under jit: a policy can be a static argument, and two equal policies share one trace
    traces = []
    f = jax.jit(lambda x, p: traces.append(p) or x + 1, static_argnums=1)
    f(jnp.ones(2), DecodePolicy("xla"))
    f(jnp.ones(2), DecodePolicy("auto"))
    assert len(traces) == 1


@pytest.mark.parametrize("kw, match", [({"backend": "cuda"}, "decode backend"), ({"moe_impl": "dense"}, "moe_impl")])
def test_bad_names_are_refused_with_the_choices(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        DecodePolicy(**kw)
    assert "one of" in str(e.value)


def test_dispatch_records_what_ran_and_why(caplog):
    x = np.random.default_rng().standard_normal(3)
    log = DispatchLog()

    def refuses():
        raise NotImplementedError(f"shape {x.shape} not served")

    common.log_once.cache_clear()
    with policy.recording(log), caplog.at_level(logging.WARNING, logger="k3jax.backends"):
        assert policy.dispatch("op_a", SPECIALIZED, lambda: "kernel", lambda: "ref") == "kernel"
        for _ in range(3):  # traced many times: logged once
            assert policy.dispatch("op_b", SPECIALIZED, refuses, lambda: "ref") == "ref"
        assert policy.dispatch("op_c", XLA, lambda: "kernel", lambda: "ref") == "ref"
    assert log.ops["op_a"] == {"impl": "pallas", "reason": None}
    assert log.ops["op_b"] == {"impl": "xla", "reason": "shape (3,) not served"}
    assert log.ops["op_c"] == {"impl": "xla", "reason": "decode backend auto"}
    assert sum("op_b" in m for m in caplog.messages) == 1
    policy.record("after", "xla")  # outside the block nothing is recorded
    assert "after" not in log.ops


def test_tuning_tables_are_data_of_the_policy():
    """A policy with a replaced gemv table launches by it (benchmarks sweep launches this way)."""
    rng = np.random.default_rng()
    B, block_k = int(rng.integers(1, 64)), int(rng.choice([64, 128, 256]))
    table = {"sm90": {"launch": [{"max_batch": 64, "block_k": block_k, "split_k": 1, "steps": 3}]}}
    p = DecodePolicy("latency_specialized", tuning=Tuning.from_files(gemv=table))
    assert gemv_api.pick_launch(B, 7168, policy=p)["block_k"] == block_k
    assert p.table("kda_decode") == XLA.table("kda_decode")  # the other tables stay the files'
    assert hash(p) != hash(SPECIALIZED)
    with pytest.raises(KeyError, match="no tuning table"):
        p.table("nope")


def test_tuning_with_entries_sets_one_entry_of_one_table():
    """Tuning.with_entries: a copy with the named entries of one table set (added where new), the rest of that
    table and every other table as they were, the original untouched; hashable, so a policy holding it is a
    different jit key."""
    base = XLA.tuning
    flipped = not base.get("collectives")["mix_norm_single_device"]
    t = base.with_entries("collectives", mix_norm_single_device=flipped, new_entry=3)
    assert t.get("collectives") == dict(base.get("collectives"), mix_norm_single_device=flipped, new_entry=3)
    assert all(t.get(op) == base.get(op) for op, _ in base.tables if op != "collectives")
    untouched = base.get("collectives")
    assert untouched["mix_norm_single_device"] is not flipped and "new_entry" not in untouched
    p = SPECIALIZED.replace(tuning=t)
    assert p.table("collectives")["mix_norm_single_device"] is flipped and hash(p) != hash(SPECIALIZED)
    with pytest.raises(KeyError, match="no tuning table"):
        base.with_entries("nope", x=1)


def test_no_environment_variable_decides_a_kernel():
    """The policy is the one switch: no module of the model, the engine or the kernels reads os.environ."""
    files = [*(ROOT / "pallas_kernels").rglob("*.py"), *(ROOT / "k3jax" / "layers").rglob("*.py")]
    files += [ROOT / "k3jax" / n for n in ("model.py", "engine.py", "comm.py", "speculative.py", "cache.py")]
    readers = [str(f.relative_to(ROOT)) for f in files if "os.environ" in f.read_text() or "getenv" in f.read_text()]
    assert not readers


def test_engine_reports_what_ran(tiny_ckpt):  # noqa: F811
    """Engine.decode_ops: every decode op with its implementation; on CPU under latency_specialized each kernel
    refuses (no GPU) and says so, under auto each op says the backend chose XLA."""
    from k3jax import checkpoint
    from k3jax.engine import Engine

    cfg, params = checkpoint.load(tiny_ckpt.ckpt, dtype=jnp.float32)
    prompt = np.random.default_rng().integers(0, cfg.vocab_size, size=3).tolist()
    ops = {}
    for backend in ("auto", "latency_specialized"):
        eng = Engine(cfg, params, max_len=16, max_batch=1, dtype=jnp.float32, backend=backend, steps_per_call=2)
        assert eng.decode_ops() == {}
        eng.generate([prompt], 3)
        ops[backend] = eng.decode_ops()
    assert set(ops["auto"]) == set(ops["latency_specialized"])
    assert {"kda_decode_x", "gemv o_proj_launch"} <= set(ops["auto"])
    assert all(v == {"impl": "xla", "reason": "decode backend auto"} for v in ops["auto"].values())
    if jax.default_backend() == "cpu":
        assert all(v["impl"] == "xla" and v["reason"] for v in ops["latency_specialized"].values())


def test_engine_takes_a_policy_or_the_names_not_both(tiny_ckpt):  # noqa: F811
    from k3jax import checkpoint
    from k3jax.engine import Engine, GenerationError

    cfg, params = checkpoint.load(tiny_ckpt.ckpt, dtype=jnp.float32)
    assert Engine(cfg, params, policy=SPECIALIZED).backend == "latency_specialized"
    with pytest.raises(GenerationError, match="not both"):
        Engine(cfg, params, policy=SPECIALIZED, backend="latency_specialized")
    with pytest.raises(GenerationError, match="decode backend"):
        Engine(cfg, params, backend="fast")


def test_engine_records_the_experts_largest_scale_byte(tiny_ckpt):  # noqa: F811
    """Under latency_specialized the engine's policy carries the loaded experts' largest E8M0 scale byte (the
    fact the MXFP4 kernels' scale_fold needs), read from the weights; under auto it stays unknown (255)."""
    from k3jax import checkpoint
    from k3jax.engine import Engine

    cfg, params = checkpoint.load(tiny_ckpt.ckpt, dtype=jnp.float32)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    want = max(int(np.max(v)) for path, v in leaves if str(path[-1].key).endswith("_scales"))
    assert 0 < want < 255
    assert Engine(cfg, params, backend="latency_specialized").policy.expert_scale_max == want
    assert Engine(cfg, params, backend="auto").policy.expert_scale_max == policy.SCALE_MAX_UNKNOWN
