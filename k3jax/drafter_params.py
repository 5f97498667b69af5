"""The DSpark drafter (docs/model.md §9): its config, its one tensor table, loading an HF drafter checkpoint.

Same conventions as the target's table (k3jax.params): `[in, out]` matmul weights (q_b and o out-major, as the
target's), head axes split out, MLA `kv_b` split into the absorbed layouts `w_uk` [H, nope, R] / `w_uv` [H, v, R];
the same logical axes, so the same rules split it under tensor parallelism (param_specs). HF names are those of §9.2,
without a prefix (a `model.` prefix is accepted when loading). `embed_tokens.weight` is a frozen copy of the
target's and is not loaded: the drafter uses the target's embedding and lm_head.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import params as P
from k3jax import transforms
from k3jax.params import TensorSpec


@dataclass(frozen=True)
class DSparkConfig:
    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 14336
    num_hidden_layers: int = 5
    num_attention_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    hidden_act: str = "silu"  # absent from the released JSON; vLLM's default (§9.1, UNCERTAIN)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 50000.0
    rope_factor: float = 32.0  # YaRN
    rope_original_max_position_embeddings: int = 32768
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 1.0
    max_position_embeddings: int = 1048576
    target_layer_ids: tuple[int, ...] = (2, 23, 47, 71, 89)
    target_hidden_size: int = 7168
    target_num_hidden_layers: int = 93
    mask_token_id: int = 163837
    markov_rank: int = 256
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """192^-1/2 * mscale^2 with the YaRN attention mscale (0.130861 for the release, §9.3)."""
        return self.qk_head_dim**-0.5 * yarn_mscale(self.rope_factor, self.rope_mscale_all_dim) ** 2

    @classmethod
    def from_hf(cls, src: str | dict) -> DSparkConfig:
        if not isinstance(src, dict):
            path = os.path.join(src, "config.json") if os.path.isdir(src) else src
            with open(path) as f:
                src = json.load(f)
        d = dict(src)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        kw: dict[str, Any] = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        for ours, theirs in (
            ("rope_factor", "factor"),
            ("rope_beta_fast", "beta_fast"),
            ("rope_beta_slow", "beta_slow"),
            ("rope_mscale", "mscale"),
            ("rope_mscale_all_dim", "mscale_all_dim"),
            ("rope_original_max_position_embeddings", "original_max_position_embeddings"),
        ):
            if theirs in rope:
                kw[ours] = rope[theirs]
        if "rope_theta" in rope:
            kw["rope_theta"] = rope["rope_theta"]
        kw["target_layer_ids"] = tuple(int(x) for x in kw.get("target_layer_ids", cls.target_layer_ids))
        if d.get("mla_use_nope", False) or d.get("mla_use_output_gate", False):
            raise ValueError("DSpark drafter: expected mla_use_nope=false and mla_use_output_gate=false")
        return cls(**kw)

    def to_hf(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("rope_")}
        d["target_layer_ids"] = list(self.target_layer_ids)
        d.update(
            architectures=["K3DSparkModel"],
            model_type="k3_dspark",
            num_key_value_heads=self.num_attention_heads,
            num_target_layers=len(self.target_layer_ids),
            mla_use_nope=False,
            mla_use_output_gate=False,
            draft_vocab_size=self.vocab_size,
            markov_head_type="vanilla",
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
        )
        d["rope_parameters"] = {
            "rope_type": "yarn",
            "rope_theta": self.rope_theta,
            "factor": self.rope_factor,
            "original_max_position_embeddings": self.rope_original_max_position_embeddings,
            "beta_fast": self.rope_beta_fast,
            "beta_slow": self.rope_beta_slow,
            "mscale": self.rope_mscale,
            "mscale_all_dim": self.rope_mscale_all_dim,
        }
        return d


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0


def yarn_inv_freq(c: DSparkConfig) -> np.ndarray:
    """DeepSeek-V3 YaRN: interpolate low frequencies by `factor`, keep high ones, linear ramp in between."""
    dim, base = c.qk_rope_head_dim, c.rope_theta
    extra = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inter = extra / c.rope_factor

    def corr_dim(rot):  # the dimension whose wavelength fits `rot` times into the original context
        orig = c.rope_original_max_position_embeddings
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(c.rope_beta_fast)), 0)
    high = min(math.ceil(corr_dim(c.rope_beta_slow)), dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 1e-3), 0, 1)
    keep = 1.0 - ramp  # 1: extrapolate (high frequency), 0: interpolate
    return inter * (1 - keep) + extra * keep


def tensor_table(c: DSparkConfig) -> list[TensorSpec]:
    D, H, V, F, r = c.hidden_size, c.num_attention_heads, c.vocab_size, c.intermediate_size, c.markov_rank
    Q, R, N, Pd, Vd = c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    Dc = len(c.target_layer_ids) * c.target_hidden_size
    t: list[TensorSpec] = []

    def add(path, hf, shape, axes, transform="copy", hf_shape=None, init="linear", fan_in=1):
        t.append(
            TensorSpec(
                tuple(path),
                hf,
                tuple(shape),
                "bfloat16",
                tuple(axes),
                transform,
                tuple(hf_shape if hf_shape is not None else shape),
                ("bfloat16", "float32"),
                init=init,
                fan_in=fan_in,
            )
        )

    def lin(path, hf, fan_in, out_shape, axes):  # HF [out, in] -> ours [in, *out]
        add(path, hf, (fan_in,) + out_shape, axes, "T", (math.prod(out_shape), fan_in), fan_in=fan_in)

    lin(("context_proj",), "context_proj.weight", Dc, (D,), ("ctx", "embed"))
    add(("context_norm",), "context_norm.weight", (D,), ("embed",), init="norm")
    for j in range(c.num_hidden_layers):
        p, h = ("layers", j), f"layers.{j}."
        add(p + ("attn_norm",), h + "input_layernorm.weight", (D,), ("embed",), init="norm")
        add(p + ("mlp_norm",), h + "post_attention_layernorm.weight", (D,), ("embed",), init="norm")
        a, ha = p + ("attn",), h + "self_attn."
        lin(a + ("q_a",), ha + "q_a_proj.weight", D, (Q,), ("embed", "q_lora"))
        add(a + ("q_a_norm",), ha + "q_a_layernorm.weight", (Q,), ("q_lora",), init="norm")
        # q_b and o out-major, as the target's (k3jax.params): mla.queries and the o_proj read them so
        add(
            a + ("q_b",),
            ha + "q_b_proj.weight",
            (H, N + Pd, Q),
            ("mla_heads", None, "q_lora"),
            "reshape",
            (H * (N + Pd), Q),
            fan_in=Q,
        )
        lin(a + ("kv_a",), ha + "kv_a_proj_with_mqa.weight", D, (R + Pd,), ("embed", None))
        add(a + ("kv_a_norm",), ha + "kv_a_layernorm.weight", (R,), (None,), init="norm")
        for name, tr, n in (("w_uk", "kvb_k", N), ("w_uv", "kvb_v", Vd)):
            add(
                a + (name,),
                ha + "kv_b_proj.weight",
                (H, n, R),
                ("mla_heads", None, None),
                tr,
                (H * (N + Vd), R),
                fan_in=R,
            )
        o_axes = ("embed", "mla_heads", None)
        add(a + ("o",), ha + "o_proj.weight", (D, H, Vd), o_axes, "reshape", (D, H * Vd), fan_in=H * Vd)
        f, hf = p + ("ffn",), h + "mlp."
        lin(f + ("gate",), hf + "gate_proj.weight", D, (F,), ("embed", "ffn"))
        lin(f + ("up",), hf + "up_proj.weight", D, (F,), ("embed", "ffn"))
        lin(f + ("down",), hf + "down_proj.weight", F, (D,), ("ffn", "embed"))
    add(("final_norm",), "final_norm.weight", (D,), ("embed",), init="norm")
    # the Markov head stays whole on every rank ("draft_vocab" is no sharding rule): it biases the gathered logits
    add(("markov_w1",), "markov_head.markov_w1.weight", (V, r), ("draft_vocab", None), init="embed")
    add(("markov_w2",), "markov_head.markov_w2.weight", (V, r), ("draft_vocab", None), fan_in=r)
    if c.enable_confidence_head:
        Dh = D + (r if c.confidence_head_with_markov else 0)
        add(("conf_w",), "confidence_head.proj.weight", (Dh,), (None,), "reshape", (1, Dh), fan_in=Dh)
        add(("conf_b",), "confidence_head.proj.bias", (), (), "reshape", (1,))
    return t


def check_tp(c: DSparkConfig, tp: int) -> None:
    """ValueError unless `tp` ranks can split the drafter's layers (param_specs): its heads and FFN intermediate."""
    for what, n in (("num_attention_heads", c.num_attention_heads), ("intermediate_size", c.intermediate_size)):
        if n % tp:
            raise ValueError(f"the DSpark drafter's {what} = {n} does not divide by tp = {tp}; use a tp dividing it")


def param_specs(c: DSparkConfig, tp: int):
    """The drafter's weights under tensor parallelism over `tp` ranks (check_tp first), by the target's rules
    (k3jax.sharding): each layer's MLA heads (q_b, w_uk / w_uv, o's columns) and FFN intermediate split, so a
    layer's attention and FFN each end in one all-reduce (k3jax.drafter); q_a, kv_a, the norms, context_proj and
    the Markov and confidence heads whole on every rank. -> a pytree of PartitionSpecs shaped like the params."""
    from k3jax import sharding as sh

    check_tp(c, tp)
    return P.unflatten({s.path: sh.spec_for(s.axes) for s in tensor_table(c)})


def init_params(c: DSparkConfig, seed: int = 0) -> dict:
    key = jax.random.key(seed)
    return P.unflatten({s.path: P.init_tensor(s, key) for s in tensor_table(c)})


def params_to_hf(flat: dict[tuple, np.ndarray], c: DSparkConfig) -> dict[str, np.ndarray]:
    """Ours {path: array} -> {HF name: array} (kv_b written once, from the w_uk entry)."""
    out = {}
    for s in tensor_table(c):
        if s.transform == "kvb_v":
            continue
        other = flat[s.path[:-1] + ("w_uv",)] if s.transform == "kvb_k" else None
        out[s.hf] = transforms.to_hf(s, np.asarray(flat[s.path]), other)[0]
    return out


def read_config(ckpt_dir: str) -> DSparkConfig:
    """The drafter's config alone (no weights), with a message saying what is wrong with the directory."""
    if not os.path.isfile(os.path.join(ckpt_dir, "config.json")):
        what = "no such directory" if not os.path.isdir(ckpt_dir) else "no config.json in it"
        raise ValueError(
            f"--draft-checkpoint {ckpt_dir}: {what}; pass an HF DSpark drafter directory (config.json + *.safetensors)"
        )
    try:
        return DSparkConfig.from_hf(ckpt_dir)
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"{ckpt_dir}/config.json: not a DSpark drafter config ({e})") from None


def check_target(c: DSparkConfig, target) -> None:
    """Refuse a drafter made for another target model, before any weight is read: it shares the target's
    embedding and lm_head (vocab, hidden size) and reads the target's hidden states at `target_layer_ids`.
    Without this the mismatch surfaces as an einsum shape error deep inside the jitted loop."""
    pairs = (
        ("vocab_size", c.vocab_size, target.vocab_size),
        ("hidden_size", c.hidden_size, target.hidden_size),
        ("target_hidden_size", c.target_hidden_size, target.hidden_size),
        ("target_num_hidden_layers", c.target_num_hidden_layers, target.num_hidden_layers),
    )
    bad = [f"{name}={ours} (target: {theirs})" for name, ours, theirs in pairs if ours != theirs]
    taps = [t for t in c.target_layer_ids if not 0 <= t < target.num_hidden_layers]
    if taps:
        bad.append(f"target_layer_ids {taps} outside the target's {target.num_hidden_layers} layers")
    if bad:
        raise ValueError(
            f"the DSpark drafter was made for another target model: {'; '.join(bad)}. "
            "Pass the drafter released with this checkpoint"
        )


def load(ckpt_dir: str, dtype=jnp.bfloat16) -> tuple[DSparkConfig, dict]:
    """(config, params) from an HF DSpark directory (config.json + *.safetensors)."""
    from convert.safetensors_io import read, read_header  # noqa: PLC0415  (host-side reader, bf16-capable)

    c = read_config(ckpt_dir)
    entries = {}
    for f in sorted(glob.glob(os.path.join(ckpt_dir, "*.safetensors"))):
        entries.update({k.removeprefix("model."): e for k, e in read_header(f).items()})
    flat = {}
    for s in tensor_table(c):
        if s.hf not in entries:
            raise ValueError(f"{ckpt_dir}: drafter tensor {s.hf!r} missing")
        a = read(entries[s.hf])
        if tuple(a.shape) != s.hf_shape:
            raise ValueError(f"{ckpt_dir}: {s.hf} has shape {list(a.shape)}, expected {list(s.hf_shape)}")
        flat[s.path] = jnp.asarray(transforms.from_hf(s, [a]), dtype)
    return c, P.unflatten(flat)
