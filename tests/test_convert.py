"""fake HF -> k3jax-convert -> k3jax.load: exact round trip, liberal input variants, every refusal, resume,
the bf16-experts path, and bounded host memory."""

import glob
import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import edit_json

from convert.core import Options, convert
from convert.fake_hf import write_fake_hf
from convert.safetensors_io import Writer, read, read_header
from convert.source import ConvertError
from k3jax import load, model
from k3jax import params as P
from k3jax.checkpoint import CheckpointError
from k3jax.config import ConfigError, preset

QUIET = Options(progress=False)


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory, seed):
    d = str(tmp_path_factory.mktemp("hf") / "tiny")
    write_fake_hf(d, preset("tiny"), seed, shards=3, vision=True, tokenizer=True)
    return d


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _leftovers(out):
    return [p for p in glob.glob(out + "*") if os.path.exists(p)]


@pytest.mark.parametrize("block_bytes", [256 << 20, 2048])  # whole tensors; every large one in row blocks
def test_roundtrip_exact(hf_tiny, seed, tmp_path, rng, block_bytes):
    out = str(tmp_path / "ck")
    meta = convert(hf_tiny, out, Options(progress=False, verify=True, workers=3, block_bytes=block_bytes))
    assert meta["source"]["skipped"] == {"vision_tower": 2, "mm_projector": 2}
    assert sorted(meta["tokenizer"]) == ["tiktoken.model", "tokenizer_config.json"]
    assert os.path.exists(os.path.join(out, "tiktoken.model"))
    assert _leftovers(out) == [out]  # staging renamed away
    cfg, params = load(out)
    assert cfg == preset("tiny")
    want = P.init_params(cfg, seed)
    for s in P.tensor_table(cfg):
        assert _same(P.get_path(params, s.path), P.get_path(want, s.path)), s.key
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(2, int(rng.integers(3, 12)))))
    fwd = jax.jit(model.forward, static_argnums=(2, 3))
    got = fwd(P.cast_params(params, jnp.float32), tokens, cfg, jnp.float32)
    ref = fwd(P.cast_params(want, jnp.float32), tokens, cfg, jnp.float32)
    assert np.array_equal(np.asarray(got), np.asarray(ref))


def test_liberal_variants(tmp_path, seed):
    """What other exporters may write (docs/model.md §7.3 UNCERTAIN): bf16 small tensors, A_log (1,1,128,1),
    one model.safetensors, a bare kimi_linear config without the language_model. prefix, eos as a list."""
    cfg = preset("tiny")
    hf = str(tmp_path / "hf")
    write_fake_hf(
        hf, cfg, seed, small_dtype="bfloat16", a_log_4d=True, single_file=True, bare_config=True, eos_list=True
    )
    assert not os.path.exists(os.path.join(hf, "model.safetensors.index.json"))
    out = str(tmp_path / "ck")
    meta = convert(hf, out, Options(progress=False, verify=True))
    assert meta["tokenizer"] == []  # absent tokenizer: a warning, not an error
    got_cfg, params = load(out)
    assert got_cfg == cfg
    want = P.init_params(cfg, seed)
    for s in P.tensor_table(cfg):
        w = np.asarray(P.get_path(want, s.path))
        if s.dtype == "float32":  # stored as bf16 by this exporter: exactly the bf16 rounding, kept in fp32
            w = w.astype(ml_dtypes.bfloat16).astype(np.float32)
        assert _same(P.get_path(params, s.path), w), s.key


# ---- refusals: each names the tensor/file (or config field) and leaves nothing that loads ---------------


def _rewrite(hf_dir, fn):
    """Re-write the shards with fn({name: array}) -> {name: array} (same file per name; new names last)."""
    idx_path = os.path.join(hf_dir, "model.safetensors.index.json")
    with open(idx_path) as f:
        idx = json.load(f)
    files = sorted(set(idx["weight_map"].values()))
    tensors = {}
    for fn_ in files:
        tensors.update({n: read(e) for n, e in read_header(os.path.join(hf_dir, fn_)).items()})
    new = fn(dict(tensors))
    where = {n: idx["weight_map"].get(n, files[-1]) for n in new}
    for fn_ in files:
        names = [n for n in new if where[n] == fn_]
        st = {
            np.dtype(ml_dtypes.bfloat16): "BF16",
            np.dtype(np.float32): "F32",
            np.dtype(np.uint8): "U8",
            np.dtype(np.int32): "I32",
        }
        w = Writer(os.path.join(hf_dir, fn_), {n: (st[new[n].dtype], new[n].shape) for n in names})
        for n in names:
            w.write(n, new[n])
        w.close()
    idx["weight_map"] = where
    with open(idx_path, "w") as f:
        json.dump(idx, f)


LM = "language_model.model."
NORM = LM + "layers.2.input_layernorm.weight"
PACKED = LM + "layers.1.block_sparse_moe.experts.3.w2.weight_packed"


def _drop(t):
    del t[NORM]
    return t


def _extra(t):
    t[LM + "layers.0.self_attn.bogus_proj.weight"] = t[NORM]
    return t


def _shape(t):
    t[NORM] = t[NORM][:-1]
    return t


def _dtype(t):
    t[NORM] = t[NORM].astype(np.int32)
    return t


def _int4_pack(t):  # an int32-packed quantisation format, not MXFP4
    t[PACKED] = np.zeros(t[PACKED].shape[:1] + (t[PACKED].shape[1] // 4,), np.int32)
    return t


def _truncate(hf):
    f = sorted(glob.glob(os.path.join(hf, "*.safetensors")))[1]
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 100)
    return os.path.basename(f)


def _bad_header(hf):
    f = sorted(glob.glob(os.path.join(hf, "*.safetensors")))[0]
    with open(f, "r+b") as fh:
        fh.seek(8)
        fh.write(b"\x00garbage{{{")
    return os.path.basename(f)


def _nan_in_data(hf):  # headers intact, one bf16 weight's exponent bits all set (what bit rot can make)
    for f in sorted(glob.glob(os.path.join(hf, "*.safetensors"))):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        entry = header.get(NORM)
        if entry is not None:
            assert entry["dtype"] == "BF16"
            with open(f, "r+b") as fh:
                fh.seek(8 + n + entry["data_offsets"][0] + 2 * 3)  # element 3
                fh.write(np.array([0x7FC1], np.uint16).tobytes())  # a NaN
            return os.path.basename(f)
    raise AssertionError(f"{NORM} in no shard")


def _config_edit(edit):
    def go(hf):
        edit_json(os.path.join(hf, "config.json"), edit)
        return "config"

    return go


def _quant(c):
    c["text_config"]["quantization_config"]["format"] = "nvfp4-pack-quantized"


def _family(c):
    c["model_type"], c["text_config"]["model_type"] = "deepseek_v3", "deepseek_v3"
    del c["text_config"]


def _act(c):
    c["text_config"]["hidden_act"] = "silu"


CASES = {
    "missing": (lambda hf: _rewrite(hf, _drop), ConvertError, ["missing", NORM]),
    "unexpected": (lambda hf: _rewrite(hf, _extra), ConvertError, ["unexpected", "bogus_proj", "model-0"]),
    "shape": (lambda hf: _rewrite(hf, _shape), ConvertError, [NORM, ".safetensors", "shape"]),
    "dtype": (lambda hf: _rewrite(hf, _dtype), ConvertError, [NORM, ".safetensors", "I32"]),
    "quant_tensor": (lambda hf: _rewrite(hf, _int4_pack), ConvertError, [PACKED, "quantization"]),
    "truncated": (_truncate, ConvertError, ["truncated"]),
    "bad_header": (_bad_header, ConvertError, ["corrupt", "header"]),
    "nan_in_data": (_nan_in_data, ConvertError, [NORM, "inf/NaN", "download it again"]),
    "quant_config": (_config_edit(_quant), ConfigError, ["quantization_config", "nvfp4"]),
    "family": (_config_edit(_family), ConfigError, ["model_type", "deepseek_v3"]),
    "activation": (_config_edit(_act), ConfigError, ["hidden_act"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refusals(case, hf_tiny, tmp_path):
    hf = str(tmp_path / "hf")
    shutil.copytree(hf_tiny, hf)
    damage, exc, words = CASES[case]
    fname = damage(hf)
    out = str(tmp_path / "out")
    with pytest.raises(exc) as e:
        convert(hf, out, QUIET)
    msg = str(e.value)
    print(msg)
    for w in words + ([fname] if fname and fname.endswith(".safetensors") else []):
        assert w in msg, (w, msg)
    assert _leftovers(out) == []
    with pytest.raises(CheckpointError, match="k3jax-convert"):
        load(out)


# ---- resume ---------------------------------------------------------------------------------------------


class _Killed(Exception):
    pass


def test_resume_after_kill(hf_tiny, seed, tmp_path):
    out = str(tmp_path / "ck")
    n_parts = 1 + preset("tiny").num_hidden_layers
    seen = []

    def kill_after_3(part):
        seen.append(part)
        if len(seen) == 3:
            raise _Killed()

    with pytest.raises(_Killed):
        convert(hf_tiny, out, Options(progress=False, workers=1), _after_part=kill_after_3)
    assert not os.path.exists(out)
    (stage,) = _leftovers(out)
    with pytest.raises(CheckpointError, match="run k3jax-convert"):
        load(stage)  # the staging directory never loads
    redone = []
    convert(hf_tiny, out, Options(progress=False, resume=True, workers=2), _after_part=redone.append)
    assert sorted(redone) == sorted(set(_all_parts(n_parts)) - set(seen))
    assert _leftovers(out) == [out]
    cfg, params = load(out)
    want = P.init_params(cfg, seed)
    for s in P.tensor_table(cfg):
        assert _same(P.get_path(params, s.path), P.get_path(want, s.path)), s.key


def _all_parts(n):
    return ["globals"] + [f"layer{i:03d}" for i in range(n - 1)]


def test_refuses_existing_output_and_non_checkpoints(hf_tiny, tmp_path):
    out = str(tmp_path / "ck")
    convert(hf_tiny, out, QUIET)
    with pytest.raises(ConvertError, match="already exists"):
        convert(hf_tiny, out, QUIET)
    with pytest.raises(CheckpointError, match="run k3jax-convert"):
        load(hf_tiny)
