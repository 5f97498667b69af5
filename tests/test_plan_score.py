"""k3jax.plan (memory planner CLI) and k3jax.score (logits CLI) end to end."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_rms

from convert.core import Options, convert
from convert.fake_hf import write_fake_hf
from k3jax import cache as cache_lib
from k3jax import model, plan, score, sharding
from k3jax import params as P
from k3jax.config import preset


def _plan_json(capsys, *args):
    rc = plan.main(["--json", *args])
    out = capsys.readouterr()
    text = out.out[out.out.find("{") :] if "{" in out.out else ""  # the rng fixture prints its seed first
    return rc, json.loads(text) if text else None, out.err


def test_plan_release_numbers(capsys, rng):
    cfg = preset("k3")
    tp, batch, ctx = 16, int(rng.integers(1, 9)), int(rng.integers(1024, 32768))
    rc, p, _ = _plan_json(capsys, "--config", "k3", "--tp", str(tp), "--batch", str(batch), "--context", str(ctx))
    assert rc == 0 and p["fits"]
    counts = P.param_counts(cfg)
    assert (p["params_total"], p["params_active"]) == (counts["total"], counts["active"])
    assert 2.7e12 < p["params_total"] < 2.9e12 and 0.9e11 < p["params_active"] < 1.2e11  # ~2.78T / ~104B
    d = p["per_device"]
    assert d["weights"] == sharding.bytes_per_device(cfg, tp)
    # independent cache arithmetic: fp8 latent rows (576 B + two fp32 scales) replicated; KDA state fp32 / tp
    mla = len(cfg.mla_layers) * batch * ctx * (cfg.kv_lora_rank + cfg.qk_rope_head_dim + 8)
    kda = len(cfg.kda_layers) * batch * cfg.kda_num_heads * cfg.kda_head_dim**2 * 4 // tp
    assert d["mla_cache"] == mla and d["kda_state"] == kda
    assert d["total"] == sum(v for k, v in d.items() if k != "total")
    assert cache_lib.cache_bytes(cfg, batch, ctx)["mla_cache"] == mla


def test_plan_refuses_what_does_not_fit(capsys):
    rc, p, err = _plan_json(capsys, "--config", "k3", "--tp", "8", "--batch", "1", "--context", "4096")
    assert rc == 1 and not p["fits"]  # 1.56 TB of weights do not fit on 8 x 141 GB
    assert "does not fit" in err and "smallest tp that fits: 16" in err
    rc, p, err = _plan_json(capsys, "--config", "k3", "--tp", "16", "--batch", "256", "--context", "1048576")
    assert rc == 1 and "MLA cache" in err
    rc, p, err = _plan_json(capsys, "--config", "k3", "--tp", "5")
    assert rc == 2 and "tp" in err and p is None


def test_score_cli_roundtrip(tmp_path, rng):
    cfg = preset("tiny")
    seed = int(rng.integers(1 << 20))
    write_fake_hf(str(tmp_path / "hf"), cfg, seed, shards=2)
    ck = str(tmp_path / "ck")
    convert(str(tmp_path / "hf"), ck, Options(progress=False))
    ids = rng.integers(0, cfg.vocab_size, size=(2, int(rng.integers(3, 10))))
    np.save(tmp_path / "ids.npy", ids)
    assert (
        score.main(["--checkpoint", ck, "--tokens", str(tmp_path / "ids.npy"), "--out", str(tmp_path / "lg.npy")]) == 0
    )
    got = np.load(tmp_path / "lg.npy")
    assert got.shape == (*ids.shape, cfg.vocab_size) and got.dtype == np.float32
    params = P.cast_params(P.init_params(cfg, seed), jnp.float32)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(model.forward, static_argnums=(2, 3))(params, jnp.asarray(ids), cfg, jnp.float32)
    assert rel_rms(got, want) < 1e-6
    np.save(tmp_path / "one.npy", ids[0])  # [T] in -> [T, V] out
    assert (
        score.main(["--checkpoint", ck, "--tokens", str(tmp_path / "one.npy"), "--out", str(tmp_path / "one_lg.npy")])
        == 0
    )
    assert rel_rms(np.load(tmp_path / "one_lg.npy"), got[0]) < 1e-5  # other batch shape: fp32 noise
    np.save(tmp_path / "bad.npy", ids + cfg.vocab_size)
    assert (
        score.main(["--checkpoint", ck, "--tokens", str(tmp_path / "bad.npy"), "--out", str(tmp_path / "x.npy")]) == 2
    )
    assert not os.path.exists(tmp_path / "x.npy")


@pytest.mark.parametrize("spec", ["tiny", "demo"])
def test_plan_small_presets_fit(capsys, spec):
    rc, p, _ = _plan_json(capsys, "--config", spec, "--tp", "1", "--batch", "4", "--context", "1024")
    assert rc == 0 and p["fits"] and p["per_device"]["weights"] == P.param_counts(preset(spec))["bytes"]
