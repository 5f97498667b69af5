"""K3Config: the released HF nesting, the layer pattern facts of docs/model.md §1.3 / §2.4, and refusals that name
the offending field."""

import copy
import json
import math

import pytest

from k3jax.config import ConfigError, K3Config, load_config, preset

MXFP4_QUANT = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "scale_dtype": "uint8",
            },
            "input_activations": None,
        }
    },
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "lm_head", "re:vision_tower.*"],
}


def published_config():
    """Written by hand from docs/model.md §1.1-§1.3 (not from to_hf): the kimi_k3 wrapper, text_config with
    linear_attn_config and quantization_config inside it, token ids at the top level only, and the unused or
    unknown keys a real file carries."""
    full = [L for L in range(4, 93, 4)] + [93]
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "pad_token_id": 163839,
        "media_placeholder_token_id": 163605,
        "tie_word_embeddings": False,
        "vision_config": {"model_type": "moonvit", "hidden_size": 1152},
        "text_config": {
            "model_type": "kimi_linear",
            "architectures": ["KimiLinearForCausalLM"],
            "vocab_size": 163840,
            "hidden_size": 7168,
            "num_hidden_layers": 93,
            "intermediate_size": 33792,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "hidden_act": "situ",
            "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0,
            "rms_norm_eps": 1e-05,
            "max_position_embeddings": 1048576,
            "attn_res_block_size": 12,
            "num_attention_heads": 96,
            "num_key_value_heads": 96,
            "head_dim": 74,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "mla_use_nope": True,
            "mla_use_output_gate": True,
            "linear_attn_config": {
                "num_heads": 96,
                "head_dim": 128,
                "short_conv_kernel_size": 4,
                "use_full_rank_gate": True,
                "gate_lower_bound": -5.0,
                "full_attn_layers": full,
                "kda_layers": [n for n in range(1, 94) if n not in full],
            },
            "num_experts": 896,
            "num_experts_per_token": 16,
            "num_shared_experts": 2,
            "moe_intermediate_size": 3072,
            "routed_expert_hidden_size": 3584,
            "latent_moe_use_norm": True,
            "moe_router_activation_func": "sigmoid",
            "moe_renormalize": True,
            "routed_scaling_factor": 1.0,
            "use_grouped_topk": True,
            "num_expert_group": 1,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "num_nextn_predict_layers": 0,
            "tie_word_embeddings": False,
            "quantization_config": copy.deepcopy(MXFP4_QUANT),
        },
    }


# ---- reading the released nesting -------------------------------------------------------------------------
def test_published_layout_reads_as_the_release():
    cfg = K3Config.from_hf(published_config())
    assert cfg == preset("k3")
    assert cfg.expert_quant == "mxfp4" and cfg.eos_token_id == 163586 and cfg.kda_gate_lower_bound == -5.0


def test_published_layout_from_a_file_and_a_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(published_config()))
    assert K3Config.from_hf(tmp_path) == preset("k3")
    assert K3Config.from_hf(tmp_path / "config.json") == preset("k3")
    assert load_config(str(tmp_path)) == preset("k3") and load_config("k3") == preset("k3")


@pytest.mark.parametrize("name", ["k3", "tiny", "demo"])
def test_to_hf_round_trip(name):
    cfg = preset(name)
    assert K3Config.from_hf(cfg.to_hf()) == cfg
    assert K3Config.from_hf(cfg.to_hf(wrapped=False)) == cfg
    assert K3Config.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg  # through real JSON (lists, null)
    bf16 = cfg.replace(expert_quant=None)
    assert "quantization_config" not in bf16.to_hf()["text_config"]
    assert K3Config.from_hf(bf16.to_hf()) == bf16


def test_to_hf_has_the_published_nesting():
    hf = preset("k3").to_hf()
    assert hf["model_type"] == "kimi_k3" and hf["text_config"]["model_type"] == "kimi_linear"
    tc, want = hf["text_config"], published_config()["text_config"]
    for key in ("linear_attn_config", "quantization_config"):
        assert key in tc and key not in hf
    for key, val in want.items():
        if key not in ("quantization_config", "topk_method"):
            assert tc[key] == val, key
    assert tc["quantization_config"]["format"] == "mxfp4-pack-quantized"


def test_eos_list_and_overrides():
    d = published_config()
    d["text_config"]["eos_token_id"] = [163586, 163585]
    cfg = K3Config.from_hf(d, num_hidden_layers=5, full_attn_layers=(4, 5))
    assert cfg.eos_token_id == 163586 and cfg.num_hidden_layers == 5 and cfg.mla_layers == (3, 4)


# ---- layer pattern (docs/model.md §1.3, §2.4) -------------------------------------------------------------
def test_release_layer_pattern():
    c = preset("k3")
    mla = {3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63, 67, 71, 75, 79, 83, 87, 91, 92}
    assert set(c.mla_layers) == mla and len(c.mla_layers) == 24
    assert set(c.kda_layers) == set(range(93)) - mla and len(c.kda_layers) == 69
    assert c.layer_kinds[0] == "kda_dense"
    assert all(k.endswith("_moe") for k in c.layer_kinds[1:])
    assert {L for L in range(93) if c.is_block_boundary(L)} == {0, 12, 24, 36, 48, 60, 72, 84}
    assert c.num_attn_res_blocks == 8
    assert c.mla_cache_width == 576 and c.qk_head_dim == 192 and c.kda_a_log_stored == 128
    assert c.shared_intermediate == 6144


def _simulated_sources(cfg):
    """Run the §2.3 loop's block bookkeeping: sources = stored blocks + the live prefix."""
    blocks, out = 0, {}
    for L in range(cfg.num_hidden_layers):
        out[L, "attn"] = blocks + 1  # the layer-0 site has only P (identity)
        if L % cfg.attn_res_block_size == 0:
            blocks += 1
        out[L, "mlp"] = blocks + 1
    return out, blocks + 1


def test_release_source_counts_table():
    """docs/model.md §2.4 table, values written out."""
    c = preset("k3")
    assert c.attn_res_sources(0, "attn") == 1
    for lo, hi, n in [
        (1, 12, 2),
        (13, 24, 3),
        (25, 36, 4),
        (37, 48, 5),
        (49, 60, 6),
        (61, 72, 7),
        (73, 84, 8),
        (85, 92, 9),
    ]:
        assert all(c.attn_res_sources(L, "attn") == n for L in range(lo, hi + 1)), (lo, hi)
    for lo, hi, n in [
        (0, 11, 2),
        (12, 23, 3),
        (24, 35, 4),
        (36, 47, 5),
        (48, 59, 6),
        (60, 71, 7),
        (72, 83, 8),
        (84, 92, 9),
    ]:
        assert all(c.attn_res_sources(L, "mlp") == n for L in range(lo, hi + 1)), (lo, hi)
    assert c.attn_res_sources(92, "output") == 9


@pytest.mark.parametrize("block, layers", [(12, 93), (3, 7), (2, 5), (4, 8), (5, 17), (1, 3)])
def test_source_counts_follow_the_decoder_loop(block, layers):
    c = preset("tiny").replace(num_hidden_layers=layers, attn_res_block_size=block, full_attn_layers=(layers,))
    sim, output = _simulated_sources(c)
    for (L, site), n in sim.items():
        assert c.attn_res_sources(L, site) == n, (L, site)
    assert c.attn_res_sources(0, "output") == output == c.num_attn_res_blocks + 1
    assert c.num_attn_res_blocks == math.ceil(layers / block)


@pytest.mark.parametrize("name", ["tiny", "demo"])
def test_small_presets_keep_the_structural_features(name):
    c = preset(name)
    assert c.layer_kinds[0] == "kda_dense" and {"kda_moe", "mla_moe"} <= set(c.layer_kinds)
    assert any(c.is_block_boundary(L) for L in range(1, c.num_hidden_layers))  # a boundary inside the model
    assert c.num_shared_experts >= 1
    if name == "tiny":  # (demo's latent equals its hidden width, 128, so that it splits 16 ways)
        assert c.routed_expert_hidden_size != c.hidden_size


# ---- refusals ---------------------------------------------------------------------------------------------
def _tc_with(**kw):
    d = published_config()
    d["text_config"].update(kw)
    return d


REFUSED_FIELDS = [
    ({"num_key_value_heads": 48}, "num_key_value_heads"),
    ({"hidden_act": "silu"}, "hidden_act"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    ({"num_experts_per_token": 897}, "num_experts_per_token"),
    ({"num_expert_group": 8, "topk_group": 4}, "num_expert_group"),
    ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"mla_use_output_gate": False}, "mla_use_output_gate"),
    ({"activation_situ_beta": 0.0}, "activation_situ_beta"),
    ({"activation_situ_linear_beta": -1.0}, "activation_situ_linear_beta"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"kv_lora_rank": -512}, "kv_lora_rank"),
    ({"attn_res_block_size": 0}, "attn_res_block_size"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"vocab_size": 1000}, "bos_token_id"),
    ({"routed_expert_hidden_size": 3600}, "routed_expert_hidden_size"),  # not a multiple of the MXFP4 group
    ({"moe_intermediate_size": 3080}, "moe_intermediate_size"),
]


@pytest.mark.parametrize("change, field", REFUSED_FIELDS, ids=[f for _, f in REFUSED_FIELDS])
def test_refusals_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        K3Config.from_hf(_tc_with(**change))


@pytest.mark.parametrize("bound", [0.0, 1.0, -7.5])
def test_gate_lower_bound_refused(bound):
    d = published_config()
    d["text_config"]["linear_attn_config"]["gate_lower_bound"] = bound
    with pytest.raises(ConfigError, match="kda_gate_lower_bound"):
        K3Config.from_hf(d)


def test_mxfp4_width_rule_only_applies_to_quantised_experts():
    d = _tc_with(routed_expert_hidden_size=3600)
    del d["text_config"]["quantization_config"]  # bf16 experts: any width
    assert K3Config.from_hf(d).routed_expert_hidden_size == 3600


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3", None])
def test_unknown_model_type(model_type):
    d = published_config()["text_config"]
    d["model_type"] = model_type
    with pytest.raises(ConfigError, match="model_type"):
        K3Config.from_hf(d)


def test_wrapper_problems():
    d = published_config()
    d["text_config"]["model_type"] = "qwen3_moe"
    with pytest.raises(ConfigError, match="text_config.model_type"):
        K3Config.from_hf(d)
    d = published_config()
    del d["text_config"]
    with pytest.raises(ConfigError, match="text_config"):
        K3Config.from_hf(d)


@pytest.mark.parametrize(
    "quant",
    [
        {"quant_method": "fp8", "format": "float-quantized"},
        {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"},
        {"quant_method": "mxfp4"},
    ],
)
def test_unsupported_quantization_format(quant):
    with pytest.raises(ConfigError, match="quantization_config"):
        K3Config.from_hf(_tc_with(quantization_config=quant))


@pytest.mark.parametrize("weights, field", [({"group_size": 16}, "weights"), ({"num_bits": 8}, "weights")])
def test_unsupported_mxfp4_group_geometry(weights, field):
    q = copy.deepcopy(MXFP4_QUANT)
    q["config_groups"]["group_0"]["weights"].update(weights)
    with pytest.raises(ConfigError, match=f"config_groups.group_0.{field}"):
        K3Config.from_hf(_tc_with(quantization_config=q))


def test_activation_quantisation_refused():
    q = copy.deepcopy(MXFP4_QUANT)
    q["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "float"}
    with pytest.raises(ConfigError, match="input_activations"):
        K3Config.from_hf(_tc_with(quantization_config=q))


def test_layer_lists_must_agree():
    d = published_config()
    la = d["text_config"]["linear_attn_config"]
    la["kda_layers"] = la["kda_layers"][:-1]  # one KDA layer missing from the list
    with pytest.raises(ConfigError, match="kda_layers"):
        K3Config.from_hf(d)
    d = published_config()
    d["text_config"]["linear_attn_config"]["full_attn_layers"].append(94)  # past the last layer
    with pytest.raises(ConfigError, match="full_attn_layers"):
        K3Config.from_hf(d)


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        K3Config.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="JSON"):
        K3Config.from_hf(tmp_path)
    with pytest.raises(ConfigError, match="preset"):
        preset("k4")


def test_direct_construction_is_validated():
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        preset("tiny").replace(num_key_value_heads=2)
    with pytest.raises(ConfigError, match="num_experts_per_token"):
        preset("tiny").replace(num_experts_per_token=9)
