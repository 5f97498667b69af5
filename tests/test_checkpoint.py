"""k3jax.load: sharded restore, refusals; the bf16-experts / fp32-trunk conversion gives the same logits;
conversion runs in bounded host memory."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import edit_json

from convert.core import Options, convert
from convert.fake_hf import write_fake_hf
from k3jax import load, model, mxfp4, sharding
from k3jax import params as P
from k3jax.checkpoint import CheckpointError
from k3jax.comm import Comm
from k3jax.config import preset
from pallas_kernels.policy import DecodePolicy

QUIET = Options(progress=False)
TP2 = preset("tiny").replace(name="tiny-tp2", moe_intermediate_size=64)  # every TP-split axis even


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, seed):
    d = tmp_path_factory.mktemp("ck")
    write_fake_hf(str(d / "hf"), TP2, seed, shards=2)
    convert(str(d / "hf"), str(d / "ck"), Options(progress=False, tp=2))
    return str(d / "hf"), str(d / "ck")


def test_load_onto_mesh(ckpt, seed):
    mesh = sharding.make_mesh(2)
    cfg, params = load(ckpt[1], mesh=mesh)
    assert cfg == TP2
    want_sh = P.flatten(sharding.param_shardings(cfg, mesh), cfg)
    want = P.init_params(cfg, seed)
    for s in P.tensor_table(cfg):
        got = P.get_path(params, s.path)
        assert got.sharding == want_sh[s.path], s.key
        ref = np.asarray(P.get_path(want, s.path))
        assert np.array_equal(np.asarray(got).view(np.uint8), ref.view(np.uint8)), s.key


def test_experts_bf16_and_fp32_trunk_same_logits(ckpt, tmp_path, rng):
    """Experts converted to dense (dequantized on conversion) give the packed checkpoint's logits: the same
    maths as its "gather" path (1e-6), and as its default "packed" path up to fp32 summation order (1e-5)."""
    b = str(tmp_path / "bf")
    convert(ckpt[0], b, Options(progress=False, experts="bf16", dtype="float32", verify=True))
    cfg, pa = load(ckpt[1], dtype=jnp.float32)
    _, pb = load(b)
    assert pb["lm_head"].dtype == jnp.float32 and pb["layers"][1]["ffn"]["experts"]["w1"].dtype == jnp.float32
    ex_a, ex_b = pa["layers"][1]["ffn"]["experts"], pb["layers"][1]["ffn"]["experts"]
    deq = mxfp4.dequantize_np(np.asarray(ex_a["w2_codes"]), np.asarray(ex_a["w2_scales"]))
    assert np.array_equal(deq, np.asarray(ex_b["w2"]))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(1, int(rng.integers(4, 12)))))
    lb = np.asarray(jax.jit(model.forward, static_argnums=(2, 3))(pb, tokens, cfg, jnp.float32))
    for impl, tol in (("gather", 1e-6), ("packed", 1e-5)):
        comm = Comm(policy=DecodePolicy(moe_impl=impl))
        la = np.asarray(jax.jit(model.forward, static_argnums=(2, 3, 4))(pa, tokens, cfg, jnp.float32, comm))
        assert np.sqrt(np.mean((la - lb) ** 2) / np.mean(la**2)) < tol, impl


def _edit_meta(src, dst, fn):
    shutil.copytree(src, dst)
    edit_json(os.path.join(dst, "k3jax_meta.json"), fn)
    return dst


def test_load_refusals(ckpt, tmp_path):
    def version(m):
        m["table_version"] += 1

    def older(m):  # the previous table's checkpoint (v5: MLA's q_a, kv_a and g in-major) is re-converted
        m["table_version"] -= 1

    def shape(m):
        m["tensors"]["final_norm"]["shape"] = [1]

    def dropped(m):
        del m["tensors"]["lm_head"]

    for fn, words in (
        (version, "tensor-table version"),
        (older, f"tensor-table version {P.TABLE_VERSION - 1} but this code reads version {P.TABLE_VERSION}"),
        (shape, "final_norm"),
        (dropped, "lm_head"),
    ):
        d = _edit_meta(ckpt[1], str(tmp_path / fn.__name__), fn)
        with pytest.raises(CheckpointError, match=words) as e:
            load(d)
        assert "k3jax-convert" in str(e.value)
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        load(ckpt[1], expect=TP2.replace(num_hidden_layers=8))
    with pytest.raises(CheckpointError, match="run k3jax-convert"):
        load(ckpt[0])  # the HF directory itself


MEM_SCRIPT = textwrap.dedent("""
    import json, sys, threading, time
    import psutil
    from convert.core import Options, convert
    from convert.source import open_source
    open_source(sys.argv[1])  # imports and header parsing are the baseline
    proc, peak, stop = psutil.Process(), [0], threading.Event()
    def sample():  # resident set size every 2 ms: the high-water mark of the conversion itself
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)
    base = proc.memory_info().rss
    t = threading.Thread(target=sample)
    t.start()
    convert(sys.argv[1], sys.argv[2], Options(progress=False, workers=2, block_bytes=1 << 20))
    stop.set()
    t.join()
    print(json.dumps({"base": base, "peak": peak[0]}))
""")


def test_bounded_host_memory(tmp_path, seed):
    """A ~70 MB 6-shard checkpoint whose embedding and lm_head are 33 MB each converts with a peak RSS growth
    of ~20 MB (measured: the same for 80 and 130 MB checkpoints, i.e. independent of model size)."""
    cfg = TP2.replace(vocab_size=1 << 18)
    hf = str(tmp_path / "hf")
    info = write_fake_hf(hf, cfg, seed, shards=6)
    budget = 32e6  # 2 workers x (1 MiB row block or one stack entry, a few copies) + allocator noise
    assert info["bytes"] > 2 * budget
    env = dict(os.environ, PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [sys.executable, "-c", MEM_SCRIPT, hf, str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        env=env,
        cwd=os.getcwd(),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    growth = m["peak"] - m["base"]
    print(f"checkpoint {info['bytes'] / 1e6:.1f} MB, peak RSS growth {growth / 1e6:.1f} MB")
    assert growth < budget
