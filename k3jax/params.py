"""The one table of every K3 tensor: our path, HF name, shape, dtype, logical axes, HF -> ours transform.

The converter, loader, sharding rules, memory planner and random initialisation all read `tensor_table`.
Our layout is `[in, out]` for matmul weights (x_BD @ w_DF), head axes split out (w_DHK), with exceptions:
- KDA's decode projections `qkvg`, `f_a` and `o` are out-major `[out, in]`, the HF rows (w_4HKD, w_RD, w_DHK):
  at batch 1 XLA turns an out-major GEMV into a reduce fusion reading weight rows contiguously (the KDA
  sublayer at one TP16 rank: 34.6 -> 31.0 us, bit-identical), and a Pallas GEMV kernel wants [out, in] too;
- the MoE sublayer's dense projections are out-major too, for the same kernel: `router` [E, D], `latent_down`
  [Dl, D], `shared_gate`/`shared_up` [S, D] (one decode-GEMV launch reads the normed x once for all four),
  `latent_up` [D, Dl] and `shared_down` [D, S];
- the MLA sublayer's projections of the normed x are out-major too, for the same kernel: `q_a` [Q, D], `kv_a`
  [R+P, D] and `g` [H, Vd, D] (one decode-GEMV launch reads x once for all three; g keeps its heads axis, split
  under TP, and a rank's [H_l, Vd, D] is its [H_l*Vd, D] rows); and so are `q_b` [H, nope+rope, Q] (in-major,
  XLA ran it at batch 1 as a multiply fusion writing the products and a column reduce reading them: 8.3 us for
  3.5 MB at one TP16 rank, bench/results/rank_slice_kernels.json) and `o` [D, H, Vd] (KDA's o_proj shape at
  TP16: the same decode-GEMV launch);
- KDA q/k/v/g projections stacked as `qkvg` [4, H, K, D] (one GEMV per step);
- KDA q/k/v conv weights stacked as `conv` [3, H, K, 4];
- MLA `kv_b` split into the absorbed decode layouts `w_uk` [H, nope, R] and `w_uv` [H, v, R];
- routed experts stacked per layer: MXFP4 codes/scales kept packed ([E, out, in/2] / [E, out, in/32], the HF
  [out, in] row layout, 32-element groups along `in`), or dequantised to bf16 [E, out, in] on request.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import MXFP4_GROUP, K3Config

# 2: KDA qkvg stacked on axis 1; 3: KDA qkvg [4, H, K, D], f_a [R, D], o [D, H, K] (out-major); 4: KDA b [H, D];
# 5: MoE router, latent_down/up and shared gate/up/down out-major; 6: MLA q_a [Q, D], kv_a [R+P, D], g [H, Vd, D];
# 7: MLA q_b [H, nope+rope, Q] and o [D, H, Vd] out-major
TABLE_VERSION = 7
HF_PREFIX = "language_model."

# Transforms from the HF tensor (after per-`stack` reading) to ours. Each takes (hf_array, spec) -> array.
#   copy       same shape
#   T          2-D [out, in] -> transpose -> reshape to the spec's shape (minus any stack axis)
#   reshape    reshape to the spec's shape (e.g. [1, D] -> [D], [C, 1, 4] -> [H, K, 4], [H*K, D] -> [H, K, D])
#   narrow     flatten, keep the first n entries (A_log: 128 stored -> H heads; docs/model.md §7.4)
#   kvb_k/kvb_v  kv_b [H*(nope+v), R] -> [H, nope+v, R] -> the k_nope or v rows
#   dequant    MXFP4 pair (weight_packed, weight_scale) -> bf16 [out, in]


@dataclass(frozen=True)
class TensorSpec:
    path: tuple[Any, ...]  # our pytree path, e.g. ("layers", 3, "attn", "q_a")
    hf: str  # HF name below "language_model."; "{s}" is replaced by each entry of `stack`
    shape: tuple[int, ...]  # our shape (including the stack axis, when stacked)
    dtype: str  # our storage dtype: bfloat16 | float32 | uint8
    axes: tuple[str | None, ...]  # logical axis names, one per dim of `shape`
    transform: str = "copy"
    hf_shape: tuple[int, ...] = ()  # shape of ONE HF tensor
    hf_dtypes: tuple[str, ...] = ("bfloat16",)  # accepted HF dtypes (the release's small tensors may be F32)
    stack: tuple[str, ...] | None = None  # values substituted into "{s}", stacked on a leading axis
    init: str = "linear"  # how init_params draws it: linear | norm | ones | alog | dt_bias | conv | codes | scales
    fan_in: int = 1
    active: float = 1.0  # fraction of this tensor read per token (routed experts: top_k / E)

    @property
    def key(self) -> str:
        return "/".join(str(p) for p in self.path)

    @property
    def hf_names(self) -> tuple[str, ...]:
        if self.stack is None:
            return (HF_PREFIX + self.hf,)
        return tuple(HF_PREFIX + self.hf.format(s=s) for s in self.stack)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def num_params(self) -> int:
        """Logical parameters: a packed MXFP4 byte holds two weights; scales are not parameters."""
        if self.init == "codes":
            return 2 * math.prod(self.shape)
        if self.init == "scales":
            return 0
        return math.prod(self.shape)


def tensor_table(cfg: K3Config, experts: str | None = None) -> list[TensorSpec]:
    """Every tensor of the text model. `experts`: 'mxfp4' (packed, default when the config is quantised)
    or 'bf16' (dequantised)."""
    experts = experts or ("mxfp4" if cfg.expert_quant == "mxfp4" else "bf16")
    if experts not in ("mxfp4", "bf16"):
        raise ValueError(f"experts must be 'mxfp4' or 'bf16', got {experts!r}")
    D, V = cfg.hidden_size, cfg.vocab_size
    t: list[TensorSpec] = []

    def add(
        path,
        hf,
        shape,
        axes,
        transform="copy",
        hf_shape=None,
        dtype="bfloat16",
        init="linear",
        fan_in=1,
        hf_dtypes=None,
        stack=None,
        active=1.0,
    ):
        t.append(
            TensorSpec(
                tuple(path),
                hf,
                tuple(shape),
                dtype,
                tuple(axes),
                transform,
                tuple(hf_shape if hf_shape is not None else shape),
                hf_dtypes or ((dtype,) if dtype != "float32" else ("float32", "bfloat16")),
                stack,
                init,
                fan_in,
                active,
            )
        )

    def norm(path, hf, n, axis="embed"):
        add(path, hf, (n,), (axis,), init="norm")

    add(("embed",), "model.embed_tokens.weight", (V, D), ("vocab", "embed"), init="embed", active=0.0)
    add(("lm_head",), "lm_head.weight", (D, V), ("embed", "vocab"), "T", (V, D), fan_in=D)
    norm(("final_norm",), "model.norm.weight", D)
    norm(("out_res", "norm"), "model.output_attn_res_norm.weight", D)
    add(("out_res", "proj"), "model.output_attn_res_proj.weight", (D,), ("embed",), "reshape", (1, D), fan_in=D)

    for L in range(cfg.num_hidden_layers):
        p, h = ("layers", L), f"model.layers.{L}."
        norm(p + ("attn_norm",), h + "input_layernorm.weight", D)
        norm(p + ("mlp_norm",), h + "post_attention_layernorm.weight", D)
        for site, hf_site in (("attn_res", "self_attention_res"), ("mlp_res", "mlp_res")):
            norm(p + (site, "norm"), h + f"{hf_site}_norm.weight", D)
            add(p + (site, "proj"), h + f"{hf_site}_proj.weight", (D,), ("embed",), "reshape", (1, D), fan_in=D)
        a, ha = p + ("attn",), h + "self_attn."
        if cfg.is_mla(L):
            _mla(add, norm, a, ha, cfg)
        else:
            _kda(add, a, ha, cfg)
        f, hf_ = p + ("ffn",), h
        if cfg.is_moe(L):
            _moe(add, norm, f, hf_ + "block_sparse_moe.", cfg, experts)
        else:
            F = cfg.intermediate_size
            add(f + ("gate",), hf_ + "mlp.gate_proj.weight", (D, F), ("embed", "ffn"), "T", (F, D), fan_in=D)
            add(f + ("up",), hf_ + "mlp.up_proj.weight", (D, F), ("embed", "ffn"), "T", (F, D), fan_in=D)
            add(f + ("down",), hf_ + "mlp.down_proj.weight", (F, D), ("ffn", "embed"), "T", (D, F), fan_in=F)
    return t


def _kda(add, a, ha, cfg: K3Config):
    D, H, K, W = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    # Decode's three large projections are out-major (the HF rows; see the module docstring). qkvg keeps D
    # last, the contracted and minor axis, so x_BD against it is one GEMV with no weight transpose: the old
    # [4, D, H, K] (stack axis leading, D in the middle) made XLA transpose the weight every step (~28 us per
    # KDA layer at one TP16 rank's widths).
    add(
        a + ("qkvg",),
        ha + "{s}_proj.weight",
        (4, H, K, D),
        ("stack", "kda_heads", "head_dim", "embed"),
        "reshape",
        (H * K, D),
        stack=("q", "k", "v", "g"),
        fan_in=D,
    )
    add(
        a + ("conv",),
        ha + "{s}_conv1d.weight",
        (3, H, K, W),
        ("stack", "kda_heads", "head_dim", None),
        "reshape",
        (H * K, 1, W),
        dtype="float32",
        init="conv",
        stack=("q", "k", "v"),
        fan_in=W,
    )
    add(a + ("f_a",), ha + "f_a_proj.weight", (K, D), (None, "embed"), fan_in=D)
    add(a + ("f_b",), ha + "f_b_proj.weight", (K, H, K), (None, "kda_heads", "head_dim"), "T", (H * K, K), fan_in=K)
    # out-major like HF: the decode kernel's fused gates read one head's row contiguously
    add(a + ("b",), ha + "b_proj.weight", (H, D), ("kda_heads", "embed"), fan_in=D)
    add(
        a + ("A_log",),
        ha + "A_log",
        (H,),
        ("kda_heads",),
        "narrow",
        (cfg.kda_a_log_stored,),
        dtype="float32",
        init="alog",
    )
    add(
        a + ("dt_bias",),
        ha + "dt_bias",
        (H, K),
        ("kda_heads", "head_dim"),
        "reshape",
        (H * K,),
        dtype="float32",
        init="dt_bias",
    )
    add(a + ("o_norm",), ha + "o_norm.weight", (K,), (None,), dtype="float32", init="norm")
    add(
        a + ("o",),
        ha + "o_proj.weight",
        (D, H, K),
        ("embed", "kda_heads", "head_dim"),
        "reshape",
        (D, H * K),
        fan_in=H * K,
    )


def _mla(add, norm, a, ha, cfg: K3Config):
    D, H = cfg.hidden_size, cfg.num_attention_heads
    Q, R, N, P, Vd = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    # q_a, kv_a and g, the three projections of the normed x, are out-major, the HF rows (see the module
    # docstring): one decode-GEMV launch reads x once for all three (layers/mla.py mla_in_projections)
    add(a + ("q_a",), ha + "q_a_proj.weight", (Q, D), ("q_lora", "embed"), fan_in=D)
    norm(a + ("q_a_norm",), ha + "q_a_layernorm.weight", Q, "q_lora")
    add(
        a + ("q_b",),
        ha + "q_b_proj.weight",
        (H, N + P, Q),
        ("mla_heads", None, "q_lora"),
        "reshape",
        (H * (N + P), Q),
        fan_in=Q,
    )
    add(a + ("kv_a",), ha + "kv_a_proj_with_mqa.weight", (R + P, D), (None, "embed"), fan_in=D)
    norm(a + ("kv_a_norm",), ha + "kv_a_layernorm.weight", R, None)
    add(
        a + ("w_uk",),
        ha + "kv_b_proj.weight",
        (H, N, R),
        ("mla_heads", None, None),
        "kvb_k",
        (H * (N + Vd), R),
        fan_in=R,
    )
    add(
        a + ("w_uv",),
        ha + "kv_b_proj.weight",
        (H, Vd, R),
        ("mla_heads", None, None),
        "kvb_v",
        (H * (N + Vd), R),
        fan_in=R,
    )
    add(a + ("g",), ha + "g_proj.weight", (H, Vd, D), ("mla_heads", None, "embed"), "reshape", (H * Vd, D), fan_in=D)
    o_axes = ("embed", "mla_heads", None)
    add(a + ("o",), ha + "o_proj.weight", (D, H, Vd), o_axes, "reshape", (D, H * Vd), fan_in=H * Vd)


def _moe(add, norm, f, hm, cfg: K3Config, experts: str):
    D, E, Dl, I, S = (
        cfg.hidden_size,
        cfg.num_experts,
        cfg.routed_expert_hidden_size,
        cfg.moe_intermediate_size,
        cfg.shared_intermediate,
    )
    # router and latent projections are split over tp (not replicated): router by expert, latent_down by its
    # output (then gathered), latent_up by its input (partial sums reduced with the shared experts'). All six
    # dense projections are out-major, the HF rows (see the module docstring).
    add(f + ("router",), hm + "gate.weight", (E, D), ("experts_router", "embed"), fan_in=D)
    add(
        f + ("router_bias",),
        hm + "gate.e_score_correction_bias",
        (E,),
        ("experts_router",),
        dtype="float32",
        init="router_bias",
    )
    add(f + ("latent_down",), hm + "routed_expert_down_proj.weight", (Dl, D), ("latent_tp", "embed"), fan_in=D)
    norm(f + ("latent_norm",), hm + "routed_expert_norm.weight", Dl, "latent")
    add(f + ("latent_up",), hm + "routed_expert_up_proj.weight", (D, Dl), ("embed", "latent_tp"), fan_in=Dl)
    for name, hf in (("shared_gate", "gate_proj"), ("shared_up", "up_proj")):
        add(f + (name,), hm + f"shared_experts.{hf}.weight", (S, D), ("shared_ffn", "embed"), fan_in=D)
    add(f + ("shared_down",), hm + "shared_experts.down_proj.weight", (D, S), ("embed", "shared_ffn"), fan_in=S)
    stack = tuple(str(e) for e in range(E))
    act = cfg.num_experts_per_token / E
    # (our name, HF w-index, out, in, axes of [out, in]); logical [out, in] as in HF, groups along `in`
    for name, w, out, inp, ax in (
        ("w1", "w1", I, Dl, ("moe_ffn", "latent")),
        ("w3", "w3", I, Dl, ("moe_ffn", "latent")),
        ("w2", "w2", Dl, I, ("latent", "moe_ffn")),
    ):
        base = hm + "experts.{s}." + w
        if experts == "mxfp4":
            add(
                f + ("experts", name + "_codes"),
                base + ".weight_packed",
                (E, out, inp // 2),
                ("experts", ax[0], ax[1] + "_packed"),
                hf_shape=(out, inp // 2),
                dtype="uint8",
                init="codes",
                stack=stack,
                fan_in=inp,
                active=act,
            )
            add(
                f + ("experts", name + "_scales"),
                base + ".weight_scale",
                (E, out, inp // MXFP4_GROUP),
                ("experts", ax[0], ax[1] + "_groups"),
                hf_shape=(out, inp // MXFP4_GROUP),
                dtype="uint8",
                init="scales",
                stack=stack,
                fan_in=inp,
                active=act,
            )
        else:
            src = ".weight_packed" if cfg.expert_quant == "mxfp4" else ".weight"
            add(
                f + ("experts", name),
                base + src,
                (E, out, inp),
                ("experts",) + ax,
                "dequant" if cfg.expert_quant == "mxfp4" else "copy",
                (out, inp // 2) if cfg.expert_quant == "mxfp4" else (out, inp),
                hf_dtypes=("uint8",) if cfg.expert_quant == "mxfp4" else ("bfloat16",),
                stack=stack,
                fan_in=inp,
                active=act,
            )


# ---- derived views --------------------------------------------------------------------------------------


def param_counts(cfg: K3Config, experts: str | None = None) -> dict[str, int]:
    table = tensor_table(cfg, experts)
    total = sum(s.num_params for s in table)
    active = sum(round(s.num_params * s.active) for s in table)
    return {"total": total, "active": active, "bytes": sum(s.nbytes for s in table)}


def abstract_params(cfg: K3Config, experts: str | None = None) -> dict:
    """The parameter pytree as jax.ShapeDtypeStruct leaves (no allocation)."""
    return unflatten({s.path: jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype)) for s in tensor_table(cfg, experts)})


def logical_axes(cfg: K3Config, experts: str | None = None) -> dict:
    return unflatten({s.path: s.axes for s in tensor_table(cfg, experts)})


def unflatten(flat: dict[tuple, Any]) -> dict:
    """{path: leaf} -> nested dicts; integer path parts become list indices (layers)."""
    root: dict = {}
    for path, leaf in flat.items():
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = leaf
    return _lists(root)


def _lists(node):
    if isinstance(node, dict):
        node = {k: _lists(v) for k, v in node.items()}
        if node and all(isinstance(k, int) for k in node):
            return [node[i] for i in range(len(node))]
    return node


def get_path(tree, path):
    for part in path:
        tree = tree[part]
    return tree


def flatten(tree, cfg: K3Config, experts: str | None = None) -> dict[tuple, Any]:
    return {s.path: get_path(tree, s.path) for s in tensor_table(cfg, experts)}


# ---- random parameters ------------------------------------------------------------------------------------


def seed_for(path) -> int:
    """A tensor's fold-in seed, from its path alone (so its value does not depend on the other tensors)."""
    return int.from_bytes(hashlib.blake2s("/".join(map(str, path)).encode(), digest_size=4).digest(), "little")


def init_tensor(spec: TensorSpec, key: jax.Array) -> jax.Array:
    """One tensor's deterministic random value (jittable, so it can be generated directly on devices)."""
    shape, dtype = spec.shape, jnp.dtype(spec.dtype)
    k = jax.random.fold_in(key, seed_for(spec.path))
    n = jax.random.normal
    if spec.init == "linear":
        return (n(k, shape, jnp.float32) / math.sqrt(spec.fan_in)).astype(dtype)
    if spec.init == "embed":
        return n(k, shape, jnp.float32).astype(dtype)
    if spec.init == "norm":
        return (1.0 + 0.1 * n(k, shape, jnp.float32)).astype(dtype)
    if spec.init == "conv":
        return (0.5 * n(k, shape, jnp.float32)).astype(dtype)
    if spec.init == "alog":  # exp(A_log) in [1, 16], as in Mamba/KDA inits
        return jnp.log(jax.random.uniform(k, shape, jnp.float32, 1.0, 16.0)).astype(dtype)
    if spec.init == "dt_bias":
        return (0.5 * n(k, shape, jnp.float32) - 1.0).astype(dtype)
    if spec.init == "router_bias":
        return (0.1 * n(k, shape, jnp.float32)).astype(dtype)
    if spec.init == "codes":
        return jax.random.randint(k, shape, 0, 256, jnp.int32).astype(jnp.uint8)
    if spec.init == "scales":
        # E2M1 magnitudes average ~2.3: 2^(e-127) ~ 1/(2.3 sqrt(fan_in)) keeps expert outputs O(1)
        centre = 127 - round(math.log2(2.3 * math.sqrt(spec.fan_in)))
        return jax.random.randint(k, shape, centre - 1, centre + 2, jnp.int32).astype(jnp.uint8)
    raise ValueError(f"unknown init {spec.init!r} for {spec.key}")


def init_params(cfg: K3Config, seed: int = 0, experts: str | None = None) -> dict:
    """Deterministic random parameters for any config (each tensor keyed by its path, so a tensor's value
    does not depend on which others exist)."""
    key = jax.random.key(seed)
    return unflatten({s.path: init_tensor(s, key) for s in tensor_table(cfg, experts)})


def experts_format(params) -> str:
    """'mxfp4' or 'bf16': which routed-expert layout a parameter tree holds."""
    for layer in params["layers"]:
        if "experts" in layer["ffn"]:
            return "mxfp4" if "w1_codes" in layer["ffn"]["experts"] else "bf16"
    return "mxfp4"


def cast_params(params, dtype) -> dict:
    """Cast the bf16 trunk to the compute dtype; fp32 tensors and packed uint8 experts stay as they are."""
    dtype = jnp.dtype(dtype)
    return jax.tree.map(lambda x: x.astype(dtype) if x.dtype == jnp.bfloat16 else x, params)


def table_summary(cfg: K3Config, experts: str | None = None) -> list[dict]:
    return [dataclasses.asdict(s) | {"key": s.key} for s in tensor_table(cfg, experts)]
