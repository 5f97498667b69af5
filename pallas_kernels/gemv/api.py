"""Dispatch for the decode GEMV: the Hopper kernel where it applies (backend="latency_specialized", sm90,
bf16, a batch that tuning.json has a launch for: <= 64), the XLA reference otherwise, the reason logged once
(logger "k3jax.backends")."""

import json
import pathlib

from pallas_kernels import common
from pallas_kernels.gemv import reference

BACKENDS = ("xla", "latency_specialized")


def tuning() -> dict:
    return json.loads((pathlib.Path(__file__).parent / "tuning.json").read_text())


def pick_launch(B, D) -> dict:
    """tuning.json's sm90 launch for batch B over D -> dict(block_k, split_k, steps, rows, x_stream);
    NotImplementedError past the last entry's max_batch."""
    entry = next((e for e in tuning()["sm90"]["launch"] if B <= e["max_batch"]), None)
    if entry is None:
        raise NotImplementedError(f"batch {B}: no GEMV launch in tuning.json (the decode GEMV serves up to "
                                  f"{tuning()['sm90']['launch'][-1]['max_batch']})")
    # split D only where it divides: o_proj's short D (768 at TP16) has row blocks enough without it
    split_k = entry["split_k"] if D % (entry["split_k"] * entry["block_k"]) == 0 else 1
    return dict(block_k=entry["block_k"], split_k=split_k, steps=entry["steps"], rows=entry.get("rows", 64),
                x_stream=entry.get("x_stream", False))


def _kernel(x_BD, ws_ND):
    arch = common.gpu_arch()
    if arch is None or arch[0] != 9:
        raise NotImplementedError(f"GEMV kernel is Hopper-only (sm90), got {arch}")
    from pallas_kernels.gemv import kernel
    launch = pick_launch(*x_BD.shape)
    kernel.check_supported(x_BD, ws_ND, **launch)
    return kernel.gemv(x_BD, tuple(ws_ND), **launch)


def gemv(x_BD, ws_ND, *, backend="xla"):
    """x [B, D] times each out-major weight [N_i, D] -> tuple of [B, N_i] in x's dtype, fp32 sums."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "latency_specialized":
        try:
            return _kernel(x_BD, ws_ND)
        except NotImplementedError as e:
            common.log_once("gemv", str(e))
    return reference.gemv(x_BD, ws_ND)
