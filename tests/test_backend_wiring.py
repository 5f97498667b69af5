"""decode_backend="latency_specialized" end to end on CPU: the model's decode steps run the Pallas KDA body (in
interpret mode, on an abstract H100/B200) and give the same logits and greedy tokens as the XLA path."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from kernel_testbase import abstract_gpu, cpu_only

from k3jax import cache as cache_lib
from k3jax import model
from k3jax import params as P
from k3jax.config import preset
from pallas_kernels import common
from pallas_kernels.kda_decode import sm90

# the kernel handles K = V = 128 (the release's head dim); everything else stays tiny
CFG = preset("tiny").replace(kda_num_heads=2, kda_head_dim=128, num_hidden_layers=3, full_attn_layers=(3,))


def _decode(params, prompt_BT, n_B, steps, backend):
    B = prompt_BT.shape[0]
    cache = cache_lib.init_cache(CFG, B, 16, jnp.float32, "bf16")
    logits, cache, _ = model.extend(params, prompt_BT, n_B, cache, CFG, jnp.float32)
    out, toks = [], []
    for _ in range(steps):
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        toks.append(np.asarray(tok))
        logits, cache, _ = model.extend(params, tok[:, None], jnp.ones((B,), jnp.int32), cache, CFG, jnp.float32,
                                        backend=backend)
        out.append(np.asarray(logits))
    return np.stack(out), np.stack(toks)


@cpu_only
@pytest.mark.parametrize("arch,body", [("sm90", sm90)])  # sm100 body: tests/test_kda_decode.py (whole-model
def test_specialized_decode_equals_xla(arch, body, rng, monkeypatch):  # interpret of it hung here, not chased)
    params = P.cast_params(P.init_params(CFG, seed=int(rng.integers(1 << 30))), jnp.float32)
    prompt = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(2, 4)), jnp.int32)
    n = jnp.asarray([4, 3], jnp.int32)
    want_logits, want_toks = _decode(params, prompt, n, 3, "xla")
    calls = []
    real = body.kda_decode
    monkeypatch.setattr(body, "kda_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    with abstract_gpu(arch), common.interpret(plgpu.InterpretGPUParams()):
        got_logits, got_toks = _decode(params, prompt, n, 3, "latency_specialized")
    assert len(calls) == 3 * len(CFG.kda_layers)  # every KDA layer of every decode step ran the Pallas body
    err = np.abs(got_logits - want_logits).max() / np.abs(want_logits).max()
    assert err <= 1e-5, err
    np.testing.assert_array_equal(got_toks, want_toks)
