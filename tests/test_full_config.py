"""The released 2.8T config on CPU without allocating: jax.eval_shape of forward and extend, parameter counts
(docs/model.md §6: ~2.78T total / ~104B active) and the HF tensor roster of docs/model.md §7.3."""

import re
import resource

import jax
import jax.numpy as jnp
import pytest

from k3jax import cache as cache_lib
from k3jax import model
from k3jax import params as P
from k3jax.config import preset

CFG = preset("k3")
I32 = jnp.int32


def _peak_rss_gib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def test_forward_traces_at_full_size():
    rss0 = _peak_rss_gib()
    params = P.abstract_params(CFG)
    out = jax.eval_shape(lambda p, t: model.forward(p, t, CFG, jnp.bfloat16), params, jax.ShapeDtypeStruct((1, 4), I32))
    assert out.shape == (1, 4, 163840) and out.dtype == jnp.bfloat16
    # the weights alone are ~1.5 TB: anything materialised would show up here (or kill the process)
    assert _peak_rss_gib() - rss0 < 2.0


@pytest.mark.parametrize("T", [1, 4])  # decode step and a prefill chunk
def test_extend_traces_at_full_size(T):
    B, S = 2, 64
    params = P.abstract_params(CFG)
    cache = jax.eval_shape(lambda: cache_lib.init_cache(CFG, B, S))
    assert cache["layers"][3]["rows"].shape == (B, S, 576)
    assert cache["layers"][0]["state"].shape == (B, 96, 128, 128)
    logits, new_cache, _ = jax.eval_shape(
        lambda p, t, n, c: model.extend(p, t, n, c, CFG, jnp.bfloat16),
        params,
        jax.ShapeDtypeStruct((B, T), I32),
        jax.ShapeDtypeStruct((B,), I32),
        cache,
    )
    assert logits.shape == (B, 163840) and logits.dtype == jnp.bfloat16
    # the new decode state has exactly the old one's structure, shapes and dtypes (it is donated and looped)
    assert jax.tree.structure(new_cache) == jax.tree.structure(cache)
    for new, old in zip(jax.tree.leaves(new_cache), jax.tree.leaves(cache), strict=True):
        assert (new.shape, new.dtype) == (old.shape, old.dtype)


def test_release_parameter_counts():
    c = CFG.param_counts()
    print(f"total {c['total'] / 1e12:.4f}T, active {c['active'] / 1e9:.2f}B, bytes {c['bytes'] / 1e12:.3f}T")
    assert 2.70e12 <= c["total"] <= 2.85e12
    assert 1.00e11 <= c["active"] <= 1.08e11


def _count_from_spec(cfg):
    """Parameter counts written out from docs/model.md §4-§7 shapes (independent of the tensor table).
    Active: the embedding row lookup is not counted, routed experts count top_k of E."""
    D, V, H, K, W = cfg.hidden_size, cfg.vocab_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    Q, R, N, Pr, Vd, Hm = (
        cfg.q_lora_rank,
        cfg.kv_lora_rank,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.num_attention_heads,
    )
    E, k, I, Dl = (cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size, cfg.routed_expert_hidden_size)
    S = cfg.num_shared_experts * I
    kda = 4 * H * K * D + 3 * H * K * W + K * D + H * K * K + H * D + H + H * K + K + D * H * K
    mla = Q * D + Q + Hm * (N + Pr) * Q + (R + Pr) * D + R + Hm * (N + Vd) * R + Hm * Vd * D + D * Hm * Vd
    moe_dense = E * D + E + Dl * D + Dl + D * Dl + 3 * S * D
    expert = 3 * I * Dl
    trunk = V * D + 3 * D  # lm_head, final norm, output AttnRes norm + proj
    for L in range(cfg.num_hidden_layers):
        ffn = moe_dense if cfg.is_moe(L) else 3 * cfg.intermediate_size * D
        trunk += 6 * D + (mla if cfg.is_mla(L) else kda) + ffn
    n_moe = sum(cfg.is_moe(L) for L in range(cfg.num_hidden_layers))
    return {"total": V * D + trunk + n_moe * E * expert, "active": trunk + n_moe * k * expert}


@pytest.mark.parametrize("name", ["k3", "tiny", "demo"])
def test_param_counts_match_the_spec_arithmetic(name):
    cfg = preset(name)
    c, want = cfg.param_counts(), _count_from_spec(cfg)
    assert (c["total"], c["active"]) == (want["total"], want["active"])


def test_release_hf_roster():
    """Every HF name once, with the §7.3 shapes: 2,460 trunk tensors + 92 x 896 x 6 expert tensors."""
    shapes = {}
    for spec in P.tensor_table(CFG):
        for name in spec.hf_names:
            assert shapes.setdefault(name, spec.hf_shape) == spec.hf_shape, name  # kv_b is listed twice
    assert len(shapes) == 2460 + 92 * 896 * 6
    roster = {  # docs/model.md §7.3, relative to language_model.model. (name suffix regex -> shape)
        r"embed_tokens\.weight": (163840, 7168),
        r"lm_head\.weight": (163840, 7168),
        r"(norm|output_attn_res_norm)\.weight": (7168,),
        r"output_attn_res_proj\.weight": (1, 7168),
        r"(input_layernorm|post_attention_layernorm|self_attention_res_norm|mlp_res_norm)\.weight": (7168,),
        r"(self_attention_res_proj|mlp_res_proj)\.weight": (1, 7168),
        r"self_attn\.[qkv]_conv1d\.weight": (12288, 1, 4),
        r"self_attn\.f_a_proj\.weight": (128, 7168),
        r"self_attn\.f_b_proj\.weight": (12288, 128),
        r"self_attn\.b_proj\.weight": (96, 7168),
        r"self_attn\.A_log": (128,),
        r"self_attn\.dt_bias": (12288,),
        r"self_attn\.o_norm\.weight": (128,),
        r"self_attn\.[qkvg]_proj\.weight": (12288, 7168),
        r"self_attn\.o_proj\.weight": (7168, 12288),
        r"self_attn\.q_a_proj\.weight": (1536, 7168),
        r"self_attn\.q_a_layernorm\.weight": (1536,),
        r"self_attn\.q_b_proj\.weight": (18432, 1536),
        r"self_attn\.kv_a_proj_with_mqa\.weight": (576, 7168),
        r"self_attn\.kv_a_layernorm\.weight": (512,),
        r"self_attn\.kv_b_proj\.weight": (24576, 512),
        r"mlp\.(gate|up)_proj\.weight": (33792, 7168),
        r"mlp\.down_proj\.weight": (7168, 33792),
        r"gate\.weight": (896, 7168),
        r"gate\.e_score_correction_bias": (896,),
        r"routed_expert_down_proj\.weight": (3584, 7168),
        r"routed_expert_norm\.weight": (3584,),
        r"routed_expert_up_proj\.weight": (7168, 3584),
        r"shared_experts\.(gate|up)_proj\.weight": (6144, 7168),
        r"shared_experts\.down_proj\.weight": (7168, 6144),
        r"experts\.N\.w[13]\.weight_packed": (3072, 1792),
        r"experts\.N\.w[13]\.weight_scale": (3072, 112),
        r"experts\.N\.w2\.weight_packed": (3584, 1536),
        r"experts\.N\.w2\.weight_scale": (3584, 96),
    }
    pats = [
        (re.compile(r"language_model\.(model\.)?(layers\.N\.(block_sparse_moe\.)?)?" + k + "$"), v)
        for k, v in roster.items()
    ]
    kinds = {(re.sub(r"\.\d+\.", ".N.", name), shape) for name, shape in shapes.items()}  # layer/expert -> N
    assert len(kinds) == 5 + 6 + 14 + 6 + 3 + 14  # global, per layer, KDA, MLA (g/o as in KDA), dense, MoE
    for name, shape in kinds:
        want = {v for pat, v in pats if pat.match(name)}
        assert want == {shape}, (name, shape, want)
