"""Tensor parallelism: one mesh axis "tp", rules from the tensor table's logical axes, TP validation.

Activations are replicated; weights are split (docs/design.md §5.2):
- KDA and MLA heads (q/k/v/g, conv, A_log, dt_bias, f_b, b; MLA q_b, w_uk/w_uv, g; o_proj by rows);
- the dense FFN, shared experts and routed experts along their intermediate (MXFP4 groups of 32 stay whole);
- the router by expert, latent_down by its output, latent_up by its input; lm_head and the embedding by vocab.
Replicated (small): norms, AttnRes vectors, KDA f_a and o_norm, MLA q_a/kv_a (and their norms).
Decode state: KDA state and conv windows split by heads; the MLA latent cache is REPLICATED on every rank,
because every head reads the whole latent under head-parallel MLA (each rank computes identical rows from the
replicated kv_a, so no communication is needed to write it).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax import params as params_lib
from k3jax.config import MXFP4_GROUP, K3Config

AXIS = "tp"

# logical axis -> mesh axis
RULES: dict[str, str | None] = {
    "vocab": AXIS,
    "kda_heads": AXIS,
    "mla_heads": AXIS,
    "ffn": AXIS,
    "shared_ffn": AXIS,
    "moe_ffn": AXIS,
    "moe_ffn_packed": AXIS,
    "moe_ffn_groups": AXIS,
    "experts_router": AXIS,
    "latent_tp": AXIS,
}


class ShardingError(ValueError):
    pass


def valid_tp_sizes(cfg: K3Config, limit: int = 1024) -> list[int]:
    return [t for t in range(1, limit + 1) if _tp_problem(cfg, t) is None]


def _tp_problem(cfg: K3Config, tp: int) -> str | None:
    checks = {
        "kda_num_heads": cfg.kda_num_heads,
        "num_attention_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size,
        "shared intermediate": cfg.shared_intermediate,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_experts": cfg.num_experts,
        "routed_expert_hidden_size": cfg.routed_expert_hidden_size,
        "vocab_size": cfg.vocab_size,
    }
    if cfg.expert_quant == "mxfp4":
        checks["MXFP4 groups of the expert intermediate"] = cfg.moe_intermediate_size // MXFP4_GROUP
    for what, n in checks.items():
        if n % tp:
            return f"{what}={n} is not divisible by tp={tp}"
    return None


def validate_tp(cfg: K3Config, tp: int) -> None:
    problem = _tp_problem(cfg, tp) if tp >= 1 else "tp must be >= 1"
    if problem:
        sizes = valid_tp_sizes(cfg, limit=max(tp, 128))
        raise ShardingError(f"tensor-parallel size {tp} is not valid for this model: {problem}. Valid sizes: {sizes}")


def spec_for(axes: tuple[str | None, ...]) -> P:
    return P(*(RULES.get(a) if a else None for a in axes))


def param_specs(cfg: K3Config, experts: str | None = None):
    return params_lib.unflatten({s.path: spec_for(s.axes) for s in params_lib.tensor_table(cfg, experts)})


def make_mesh(tp: int, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    if tp > len(devices):
        raise ShardingError(
            f"tp={tp} needs {tp} devices but only {len(devices)} are visible "
            f"({jax.process_count()} process(es)); lower --tp or add hosts"
        )
    return Mesh(np.array(devices[:tp]), (AXIS,))


def param_shardings(cfg: K3Config, mesh: Mesh, experts: str | None = None):
    validate_tp(cfg, mesh.shape[AXIS])
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(cfg, experts), is_leaf=lambda x: isinstance(x, P))


def cache_specs(cache: dict):
    """KDA state [B,H,K,V] and conv [B,3,W,H,K] by heads; lengths and the MLA latent cache replicated."""

    def entry(e):
        if "state" in e:
            return {"state": P(None, AXIS), "conv": P(None, None, None, AXIS)}
        return {k: P() for k in e}

    return {"lengths": P(), "layers": [entry(e) for e in cache["layers"]]}


def cache_shardings(cache: dict, mesh: Mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), cache_specs(cache), is_leaf=lambda x: isinstance(x, P))


def bytes_per_device(cfg: K3Config, tp: int, experts: str | None = None) -> int:
    """Weight bytes held by one rank (split tensors / tp, replicated ones whole)."""
    total = 0
    for s in params_lib.tensor_table(cfg, experts):
        split = any(RULES.get(a) for a in s.axes if a)
        total += s.nbytes // tp if split else s.nbytes
    return total


def active_bytes_per_device(cfg: K3Config, tp: int, experts: str | None = None) -> int:
    """Weight bytes one rank reads per decoded token at batch 1 (routed experts: top-k of E; no embedding)."""
    total = 0.0
    for s in params_lib.tensor_table(cfg, experts):
        split = any(RULES.get(a) for a in s.axes if a)
        total += s.nbytes * s.active / (tp if split else 1)
    return int(math.ceil(total))
