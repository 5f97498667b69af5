"""Memory planner: will this model, batch and context fit on `tp` devices? Answered before any allocation.

    python -m k3jax.plan --config k3 --tp 8 --batch 64 --context 131072 [--json] [--cache-dtype fp8|bf16]

Per device: weights (`sharding.bytes_per_device`: TP-split tensors / tp, replicated ones whole), the decode
state (`cache.cache_bytes`): the KDA recurrent state and conv windows are split by heads over tp, the MLA
latent cache is REPLICATED on every rank (under plain head-parallel TP every head reads the whole latent),
plus a fixed reserve for activations, XLA workspace and fragmentation. Exit status 1 when it does not fit.
"""

from __future__ import annotations

import argparse
import json
import sys

from k3jax import cache as cache_lib
from k3jax import sharding
from k3jax.config import K3Config, load_config
from k3jax.params import param_counts

GB = 1e9


class PlanError(ValueError):
    pass


def plan(
    cfg: K3Config,
    tp: int,
    batch: int,
    context: int,
    cache_dtype: str = "fp8",
    hbm_gb: float = 141.0,
    reserve_gb: float = 6.0,
    experts: str | None = None,
) -> dict:
    """Per-device byte budget; raises PlanError (with a suggestion) if it does not fit in hbm_gb."""
    sharding.validate_tp(cfg, tp)
    if batch < 1 or context < 1:
        raise PlanError(f"batch and context must be >= 1 (got batch={batch}, context={context})")
    if context > cfg.max_position_embeddings:
        raise PlanError(f"context {context} exceeds max_position_embeddings={cfg.max_position_embeddings}")
    counts = param_counts(cfg, experts)
    c = cache_lib.cache_bytes(cfg, batch, context, cache_dtype)
    dev = {
        "weights": sharding.bytes_per_device(cfg, tp, experts),
        "mla_cache": c["mla_cache"],  # replicated over tp
        "kda_state": -(-c["kda_state"] // tp),
        "kda_conv": -(-c["kda_conv"] // tp),
        "reserve": int(reserve_gb * GB),
    }
    dev["total"] = sum(dev.values())
    out = {
        "config": cfg.name,
        "tp": tp,
        "batch": batch,
        "context": context,
        "cache_dtype": cache_dtype,
        "params_total": counts["total"],
        "params_active": counts["active"],
        "weight_bytes_total": counts["bytes"],
        "per_device": dev,
        "hbm_bytes": int(hbm_gb * GB),
        "fits": dev["total"] <= hbm_gb * GB,
    }
    if not out["fits"]:
        ok = [
            t
            for t in sharding.valid_tp_sizes(cfg, 256)
            if t > tp and _fits(cfg, t, batch, context, cache_dtype, hbm_gb, reserve_gb, experts)
        ]
        hint = f"; smallest tp that fits: {ok[0]}" if ok else "; no tp size fits: lower --batch or --context"
        out["error"] = (
            f"does not fit: {dev['total'] / GB:.1f} GB per device needed (weights "
            f"{dev['weights'] / GB:.1f}, MLA cache {dev['mla_cache'] / GB:.1f}, KDA state "
            f"{(dev['kda_state'] + dev['kda_conv']) / GB:.1f}, reserve {reserve_gb:.1f}) > "
            f"{hbm_gb:.0f} GB HBM{hint}"
        )
    return out


def _fits(cfg, tp, batch, context, cache_dtype, hbm_gb, reserve_gb, experts) -> bool:
    try:
        return plan(cfg, tp, batch, context, cache_dtype, hbm_gb, reserve_gb, experts)["fits"]
    except ValueError:
        return False


def _format(p: dict) -> str:
    d = p["per_device"]
    rows = [
        f"config {p['config']}: {p['params_total'] / 1e9:,.1f} B parameters, "
        f"{p['params_active'] / 1e9:,.2f} B active per token; "
        f"weights {p['weight_bytes_total'] / GB:,.1f} GB in total",
        f"tp={p['tp']} batch={p['batch']} context={p['context']} cache={p['cache_dtype']}; per device:",
    ]
    for k in ("weights", "mla_cache", "kda_state", "kda_conv", "reserve", "total"):
        rows.append(f"  {k:<10} {d[k] / GB:10.2f} GB")
    rows.append(f"  {'HBM':<10} {p['hbm_bytes'] / GB:10.2f} GB -> {'fits' if p['fits'] else 'DOES NOT FIT'}")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3jax.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="k3", help="preset (k3, tiny, demo), config.json or checkpoint dir")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--cache-dtype", choices=cache_lib.CACHE_DTYPES, default="fp8")
    ap.add_argument("--experts", choices=("mxfp4", "bf16"), default=None)
    ap.add_argument("--hbm-gb", type=float, default=141.0, help="HBM per device in GB (H200: 141)")
    ap.add_argument("--reserve-gb", type=float, default=6.0, help="activations + XLA workspace per device")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="full tracebacks on the terminal")
    a = ap.parse_args(argv)

    def run() -> int:
        cfg = _config(a.config)
        p = plan(cfg, a.tp, a.batch, a.context, a.cache_dtype, a.hbm_gb, a.reserve_gb, a.experts)
        print(json.dumps(p, indent=1) if a.json else _format(p))
        if not p["fits"]:
            print(f"k3jax.plan: {p['error']}", file=sys.stderr)
            return 1
        return 0

    from k3jax import errors

    return errors.cli_main("k3jax.plan", run, verbose=a.verbose)


def _config(spec: str) -> K3Config:
    import os

    if os.path.isdir(spec) and os.path.exists(os.path.join(spec, "k3jax_meta.json")):
        from k3jax.checkpoint import load_config as ckpt_config

        return ckpt_config(spec)
    return load_config(spec)


if __name__ == "__main__":
    sys.exit(main())
