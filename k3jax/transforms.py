"""HF tensor <-> our tensor, per tensor-table entry (both directions, NumPy, host side).

`from_hf` is what the converter applies; `to_hf` is its inverse, used by convert/fake_hf.py to write
K3-format checkpoints and by tests to feed the independent NumPy reference.
"""

from __future__ import annotations

import numpy as np

from k3jax import mxfp4
from k3jax.params import TensorSpec


def _one_from_hf(spec: TensorSpec, a: np.ndarray, companion: np.ndarray | None = None) -> np.ndarray:
    shape = spec.shape
    if spec.stack is not None:
        shape = shape[1:]
    t = spec.transform
    if t == "copy":
        return a.reshape(shape)
    if t == "T":
        return np.ascontiguousarray(a.T).reshape(shape)
    if t == "reshape":
        return a.reshape(shape)
    if t == "narrow":
        return a.reshape(-1)[: shape[0]]
    if t in ("kvb_k", "kvb_v"):
        H, n, R = shape
        per_head = a.reshape(H, -1, R)
        return per_head[:, :n] if t == "kvb_k" else per_head[:, per_head.shape[1] - n :]
    if t == "dequant":
        return mxfp4.dequantize_np(a, companion, np.float32)
    raise ValueError(f"unknown transform {t!r} for {spec.key}")


def from_hf(spec: TensorSpec, arrays: list[np.ndarray], companions: list | None = None) -> np.ndarray:
    """HF arrays (one per stack entry, or one) -> our array in the spec's dtype."""
    companions = companions or [None] * len(arrays)
    outs = [_one_from_hf(spec, a, c) for a, c in zip(arrays, companions, strict=True)]
    out = np.stack(outs) if spec.stack is not None else outs[0]
    return out.astype(_np_dtype(spec.dtype))


def to_hf(spec: TensorSpec, ours: np.ndarray, kv_b_other: np.ndarray | None = None) -> list[np.ndarray]:
    """Our array -> the HF array(s) (one per stack entry). kv_b needs both halves: pass the other one."""
    parts = list(ours) if spec.stack is not None else [ours]
    t = spec.transform
    out = []
    for a in parts:
        if t in ("copy", "reshape"):
            out.append(a.reshape(spec.hf_shape))
        elif t == "T":
            out.append(np.ascontiguousarray(a.reshape(-1, spec.hf_shape[0]).T).reshape(spec.hf_shape))
        elif t == "narrow":
            full = np.zeros(spec.hf_shape, a.dtype).reshape(-1)
            full[: a.shape[0]] = a
            out.append(full.reshape(spec.hf_shape))
        elif t == "kvb_k":  # w_uk [H, n, R] + w_uv [H, v, R] -> [H*(n+v), R]
            out.append(np.concatenate([a, kv_b_other], axis=1).reshape(spec.hf_shape))
        else:
            raise ValueError(f"no inverse for transform {t!r} ({spec.key})")
    return out


def _np_dtype(name: str):
    import ml_dtypes

    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def params_to_hf(flat: dict[tuple, np.ndarray], table: list[TensorSpec]) -> dict[str, np.ndarray]:
    """Our flat params {path: array} -> {full HF name: array}. kv_b is written once (from the w_uk entry)."""
    hf: dict[str, np.ndarray] = {}
    for spec in table:
        if spec.transform == "kvb_v":
            continue
        other = flat[spec.path[:-1] + ("w_uv",)] if spec.transform == "kvb_k" else None
        for name, arr in zip(spec.hf_names, to_hf(spec, np.asarray(flat[spec.path]), other), strict=True):
            hf[name] = arr
    return hf
