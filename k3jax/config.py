"""K3Config: every `text_config` field of the released Kimi K3 (docs/model.md §1), presets, derived facts.

The config is a frozen dataclass so it can be a static argument under `jax.jit`. Every field carries its HF key
(`_HF_KEYS`); `from_hf` reads the released nesting (top-level `kimi_k3` wrapper -> `text_config`, with the
`quantization_config` inside `text_config`) and `to_hf` writes it back. Derived facts (layer kinds, AttnRes
boundaries and source counts, parameter counts) live here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A config that K3 code cannot run; the message names the offending field."""


MXFP4_GROUP = 32  # elements per E8M0 scale along the input axis (docs/model.md §7.2)
MLA_LOWRANK_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm (docs/model.md §1.4: the HF reference default)
L2NORM_EPS = 1e-6  # KDA q/k L2 norm, inside the sqrt (FLA in-kernel form)
MLA_FAMILY = ("kimi_linear",)
WRAPPER_FAMILY = ("kimi_k3",)


@dataclass(frozen=True)
class K3Config:
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    intermediate_size: int = 33792
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float | None = 25.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    attn_res_block_size: int = 12
    # MLA
    num_attention_heads: int = 96
    num_key_value_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    # KDA (linear_attn_config)
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    kda_conv_size: int = 4
    kda_use_full_rank_gate: bool = True
    kda_gate_lower_bound: float = -5.0
    full_attn_layers: tuple[int, ...] = tuple(range(4, 93, 4)) + (93,)  # 1-based, as in the HF config
    # MoE
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    # tokens
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    # quantization of the routed experts as stored in HF ("mxfp4" or None = bf16 experts)
    expert_quant: str | None = "mxfp4"
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        validate(self)

    # ---- derived facts (one place) -------------------------------------------------------------------
    def is_mla(self, layer: int) -> bool:
        """docs/model.md §1.3: layer L (0-based) is MLA iff L+1 is in full_attn_layers."""
        return (layer + 1) in self.full_attn_layers

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def layer_kind(self, layer: int) -> str:
        """'kda_dense', 'kda_moe', 'mla_dense' or 'mla_moe'."""
        return ("mla" if self.is_mla(layer) else "kda") + ("_moe" if self.is_moe(layer) else "_dense")

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(self.layer_kind(L) for L in range(self.num_hidden_layers))

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(L for L in range(self.num_hidden_layers) if self.is_mla(L))

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(L for L in range(self.num_hidden_layers) if not self.is_mla(L))

    def is_block_boundary(self, layer: int) -> bool:
        """AttnRes: the entering prefix is snapshotted as a block at L % block_size == 0 (docs/model.md §2.3)."""
        return layer % self.attn_res_block_size == 0

    @property
    def num_attn_res_blocks(self) -> int:
        """Stored blocks at the output (8 for the release; + the live prefix = 9 sources)."""
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size)

    def attn_res_sources(self, layer: int, site: str) -> int:
        """Number of softmax sources at a mix site (docs/model.md §2.4): site in {'attn', 'mlp', 'output'}."""
        b = self.attn_res_block_size
        if site == "attn":
            return 1 if layer == 0 else math.ceil(layer / b) + 1
        if site == "mlp":
            return layer // b + 2
        if site == "output":
            return self.num_attn_res_blocks + 1
        raise ValueError(f"unknown AttnRes site {site!r}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_width(self) -> int:
        """One cached row per token per MLA layer: [normalised latent c | k_pe] (576 in the release)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_a_log_stored(self) -> int:
        """HF stores A_log padded to a multiple of 128 entries (docs/model.md §7.4)."""
        return math.ceil(self.kda_num_heads / 128) * 128

    @property
    def shared_intermediate(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    def param_counts(self) -> dict[str, int]:
        """Total and per-token active parameters (from the tensor table, so it can never disagree)."""
        from k3jax.params import param_counts

        return param_counts(self)

    # ---- HF I/O ---------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, src: str | os.PathLike | dict[str, Any], **overrides) -> K3Config:
        """Read an HF `config.json` (path to the file or its directory, or the parsed dict).

        Accepts the released nesting (model_type `kimi_k3` with `text_config`) or a bare `kimi_linear`
        text config.
        """
        if not isinstance(src, dict):
            path = os.fspath(src)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.exists(path):
                raise ConfigError(f"no config.json at {path!r}: pass an HF K3 checkpoint directory")
            with open(path) as f:
                try:
                    src = json.load(f)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}: not valid JSON ({e})") from None
        d = dict(src)
        if d.get("model_type") in WRAPPER_FAMILY or "text_config" in d:
            if "text_config" not in d:
                raise ConfigError("config.text_config: missing (a kimi_k3 config nests the text model there)")
            top = d
            d = dict(d["text_config"])
            for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if k not in d and k in top:
                    d[k] = top[k]
        elif d.get("model_type") not in MLA_FAMILY:
            raise ConfigError(
                f"config.model_type: {d.get('model_type')!r} is not a Kimi K3 config "
                f"(expected one of {WRAPPER_FAMILY + MLA_FAMILY})"
            )
        if d.get("model_type", "kimi_linear") not in MLA_FAMILY:
            raise ConfigError(f"text_config.model_type: {d.get('model_type')!r}, expected 'kimi_linear'")
        kw: dict[str, Any] = {}
        for f_name, hf_key in _HF_KEYS.items():
            val = _lookup(d, hf_key)
            if val is not _MISSING:
                kw[f_name] = val
        if "full_attn_layers" in kw:
            kw["full_attn_layers"] = tuple(int(x) for x in kw["full_attn_layers"])
        eos = kw.get("eos_token_id")
        if isinstance(eos, list):
            kw["eos_token_id"] = int(eos[0])
        kw["expert_quant"] = _expert_quant(d.get("quantization_config"))
        kda_listed = _lookup(d, "linear_attn_config.kda_layers")
        kw.update(overrides)
        cfg = cls(**kw)
        # the layer kind is read from full_attn_layers; an HF kda_layers list that disagrees means a config we
        # would silently misread
        if kda_listed is not _MISSING and not {"num_hidden_layers", "full_attn_layers"} & set(overrides):
            if sorted(int(x) for x in kda_listed) != [L + 1 for L in cfg.kda_layers]:
                raise ConfigError(
                    "text_config.linear_attn_config.kda_layers: must list exactly the 1-based "
                    "layers not in full_attn_layers"
                )
        return cfg

    def to_hf(self, wrapped: bool = True) -> dict[str, Any]:
        """The HF config dict (released nesting when `wrapped`)."""
        tc: dict[str, Any] = {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"]}
        for f_name, hf_key in _HF_KEYS.items():
            val = getattr(self, f_name)
            if isinstance(val, tuple):
                val = list(val)
            _assign(tc, hf_key, val)
        la = tc["linear_attn_config"]
        la["kda_layers"] = [L + 1 for L in self.kda_layers]
        tc["head_dim"] = self.hidden_size // self.num_attention_heads  # unused auto-derived HF attribute
        if self.expert_quant == "mxfp4":
            tc["quantization_config"] = {
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
                            "group_size": MXFP4_GROUP,
                            "scale_dtype": "uint8",
                        },
                        "input_activations": None,
                    }
                },
                "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "lm_head", "re:vision_tower.*"],
            }
        if not wrapped:
            return tc
        return {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "media_placeholder_token_id": 163605,
            "tie_word_embeddings": False,
            "text_config": tc,
            "vision_config": {},
        }

    def replace(self, **kw) -> K3Config:
        return dataclasses.replace(self, **kw)


_MISSING = object()

# field name -> HF key inside text_config ("a.b" for nested keys). The single map used by from_hf and to_hf.
_HF_KEYS: dict[str, str] = {
    f.name: f.name
    for f in dataclasses.fields(K3Config)
    if f.name not in ("expert_quant", "name") and not f.name.startswith("kda_") and f.name != "full_attn_layers"
}
_HF_KEYS.update(
    kda_num_heads="linear_attn_config.num_heads",
    kda_head_dim="linear_attn_config.head_dim",
    kda_conv_size="linear_attn_config.short_conv_kernel_size",
    kda_use_full_rank_gate="linear_attn_config.use_full_rank_gate",
    kda_gate_lower_bound="linear_attn_config.gate_lower_bound",
    full_attn_layers="linear_attn_config.full_attn_layers",
)


def _lookup(d: dict, key: str):
    for part in key.split("."):
        if not isinstance(d, dict) or part not in d:
            return _MISSING
        d = d[part]
    return d


def _assign(d: dict, key: str, val):
    parts = key.split(".")
    for part in parts[:-1]:
        d = d.setdefault(part, {})
    d[parts[-1]] = val


def _expert_quant(q: dict | None) -> str | None:
    if not q:
        return None
    method, fmt = q.get("quant_method"), q.get("format")
    if method == "compressed-tensors" and fmt == "mxfp4-pack-quantized":
        for name, group in (q.get("config_groups") or {}).items():
            w = group.get("weights") or {}
            if w.get("num_bits", 4) != 4 or w.get("group_size", MXFP4_GROUP) != MXFP4_GROUP:
                raise ConfigError(
                    f"text_config.quantization_config.config_groups.{name}.weights: "
                    f"num_bits={w.get('num_bits')!r} group_size={w.get('group_size')!r}; "
                    f"MXFP4 is 4-bit in groups of {MXFP4_GROUP}"
                )
            if group.get("input_activations"):
                raise ConfigError(
                    f"text_config.quantization_config.config_groups.{name}.input_activations: "
                    "activation quantisation is not supported (K3 is W4A16)"
                )
        return "mxfp4"
    raise ConfigError(
        f"text_config.quantization_config: quant_method={method!r} format={fmt!r} is not supported "
        "(K3 ships compressed-tensors 'mxfp4-pack-quantized'; dequantized BF16 experts need no quantization_config)"
    )


def validate(c: K3Config) -> None:
    """Refuse configs that K3 code cannot run, naming the field."""

    def need(ok: bool, fld: str, msg: str):
        if not ok:
            raise ConfigError(f"{fld}: {msg} (got {getattr(c, fld, '?')!r})")

    for fld in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "kda_num_heads",
        "kda_head_dim",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "v_head_dim",
        "num_experts",
        "num_experts_per_token",
        "moe_intermediate_size",
        "routed_expert_hidden_size",
        "attn_res_block_size",
        "kda_conv_size",
    ):
        need(isinstance(getattr(c, fld), int) and getattr(c, fld) > 0, fld, "must be a positive integer")
    need(c.hidden_act == "situ", "hidden_act", "only 'situ' (K3's SiTU-GLU) is supported")
    need(c.moe_router_activation_func == "sigmoid", "moe_router_activation_func", "only 'sigmoid' is supported")
    need(c.kda_gate_lower_bound < 0, "kda_gate_lower_bound", "the decay-gate lower bound must be < 0")
    need(c.kda_gate_lower_bound >= -5, "kda_gate_lower_bound", "must be >= -5 (bounded gate, docs/model.md §4.3)")
    need(c.mla_use_nope, "mla_use_nope", "K3 MLA is NoPE; rotary MLA is not implemented")
    need(
        c.mla_use_output_gate, "mla_use_output_gate", "K3 MLA has a sigmoid output gate; ungated MLA is not implemented"
    )
    need(c.activation_situ_beta > 0, "activation_situ_beta", "SiTU divides by beta: must be > 0")
    need(
        c.activation_situ_linear_beta is None or c.activation_situ_linear_beta > 0,
        "activation_situ_linear_beta",
        "the up soft-cap divides by it: must be > 0 (or null for no cap)",
    )
    need(c.kda_use_full_rank_gate, "kda_use_full_rank_gate", "K3 uses a full-rank g_proj gate")
    need(c.qk_rope_head_dim >= 0, "qk_rope_head_dim", "must be >= 0")
    need(
        c.num_key_value_heads == c.num_attention_heads,
        "num_key_value_heads",
        "must equal num_attention_heads (MLA has per-head K/V from the latent)",
    )
    need(c.num_experts_per_token <= c.num_experts, "num_experts_per_token", "must be <= num_experts")
    need(
        c.num_expert_group == 1 and c.topk_group == 1,
        "num_expert_group",
        "grouped top-k with more than one group is not supported (K3 uses one group)",
    )
    need(c.num_nextn_predict_layers == 0, "num_nextn_predict_layers", "K3 has no MTP head")
    need(not c.tie_word_embeddings, "tie_word_embeddings", "K3 has an untied lm_head")
    need(c.first_k_dense_replace >= 0, "first_k_dense_replace", "must be >= 0")
    need(c.moe_layer_freq >= 1, "moe_layer_freq", "must be >= 1")
    need(
        all(1 <= x <= c.num_hidden_layers for x in c.full_attn_layers),
        "full_attn_layers",
        f"1-based layer numbers must lie in 1..{c.num_hidden_layers}",
    )
    need(c.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
    if c.expert_quant is not None:
        need(c.expert_quant == "mxfp4", "expert_quant", "only 'mxfp4' or None (bf16) experts")
        for fld in ("routed_expert_hidden_size", "moe_intermediate_size"):
            need(getattr(c, fld) % MXFP4_GROUP == 0, fld, f"MXFP4 experts need a multiple of {MXFP4_GROUP}")
    for fld in ("bos_token_id", "eos_token_id", "pad_token_id"):
        need(0 <= getattr(c, fld) < c.vocab_size, fld, f"must be a token id below vocab_size={c.vocab_size}")


def _release() -> K3Config:
    return K3Config(name="k3")


def _tiny() -> K3Config:
    """Every structural feature at toy widths: dense layer 0, KDA and MLA layers, AttnRes boundaries inside
    the model (block size 3 over 7 layers), latent MoE with a shared expert, latent width != hidden width."""
    return K3Config(
        name="tiny",
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=7,
        intermediate_size=96,
        attn_res_block_size=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        kda_num_heads=4,
        kda_head_dim=16,
        full_attn_layers=(4, 7),
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=32,
        routed_expert_hidden_size=96,
        max_position_embeddings=4096,
        bos_token_id=256,
        eos_token_id=258,
        pad_token_id=511,
    )


def _demo() -> K3Config:
    """The embedded demo model: still tiny, but every width divides by 16 (MXFP4 groups included), so it runs
    at every TP size up to 16."""
    return _tiny().replace(
        name="demo",
        hidden_size=128,
        num_hidden_layers=8,
        intermediate_size=256,
        attn_res_block_size=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        kda_num_heads=16,
        kda_head_dim=16,
        q_lora_rank=64,
        kv_lora_rank=64,
        full_attn_layers=(4, 8),
        num_experts=16,
        num_experts_per_token=4,
        num_shared_experts=2,
        moe_intermediate_size=512,
        routed_expert_hidden_size=96,
        max_position_embeddings=8192,
    )


PRESETS = {"k3": _release, "tiny": _tiny, "demo": _demo}


def preset(name: str) -> K3Config:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)} or pass a config.json path")
    return PRESETS[name]()


def load_config(spec: str) -> K3Config:
    """A preset name, a config.json path, or a checkpoint directory holding one."""
    looks_like_path = os.sep in spec or spec.endswith(".json") or os.path.exists(spec)
    return K3Config.from_hf(spec) if looks_like_path else preset(spec)  # a typo'd preset names the presets
