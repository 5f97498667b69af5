"""The HF side: open a K3 checkpoint directory, read every shard header, validate it against the tensor table.

Everything here is metadata only (no tensor data is read), so every error is raised before any output exists.
Liberal where the release format is UNCERTAIN (docs/model.md §7.3/§7.4): small float tensors may be BF16, F16 or
F32; A_log may be [128], [H] or any shape with those many entries (e.g. (1, 1, 128, 1)); [1, D] AttnRes
projections and [d, 1, 4] conv weights may come without their unit axes; a single `model.safetensors` without
an index; a bare `kimi_linear` config and checkpoint without the `language_model.` prefix.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field

from convert.safetensors_io import Entry, ShardError, read_header
from k3jax import params as P
from k3jax.config import K3Config

SKIP_PREFIXES = ("vision_tower.", "mm_projector.")  # the multimodal wrapper's non-text parts
SKIP_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exporters write; K3 has no RoPE
FLOAT_DTYPES = ("BF16", "F16", "F32")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class ConvertError(ValueError):
    """A checkpoint we refuse to convert; the message names the tensor and the file."""


@dataclass
class Source:
    hf_dir: str
    cfg: K3Config
    entries: dict[str, Entry]  # every tensor of every shard, by full name
    files: list[str]
    prefix: str  # "language_model." (release) or "" (bare kimi_linear checkpoint)
    skipped: dict[str, int] = field(default_factory=dict)

    def entry(self, table_name: str) -> Entry:
        return self.entries[self.name(table_name)]

    def name(self, table_name: str) -> str:
        return self.prefix + table_name.removeprefix(P.HF_PREFIX)


def open_source(hf_dir: str) -> Source:
    """Read config.json, the index (or the single file) and every shard header."""
    if not os.path.isdir(hf_dir):
        raise ConvertError(f"{hf_dir}: not a directory (pass an HF K3 checkpoint directory)")
    cfg = K3Config.from_hf(hf_dir)  # ConfigError for configs outside the K3 family
    index_path = os.path.join(hf_dir, INDEX)
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConvertError(f"{INDEX}: unreadable index ({e!r})") from None
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(hf_dir, SINGLE)):
        weight_map, files = None, [SINGLE]
    else:
        raise ConvertError(f"{hf_dir}: neither {INDEX} nor {SINGLE} found")
    entries: dict[str, Entry] = {}
    for fname in files:
        path = os.path.join(hf_dir, fname)
        if not os.path.exists(path):
            raise ConvertError(f"{fname}: shard named in {INDEX} is missing from {hf_dir}")
        try:
            head = read_header(path)
        except ShardError as e:
            raise ConvertError(str(e)) from None
        for name, e in head.items():
            if name in entries:
                raise ConvertError(
                    f"tensor {name!r} appears in both {os.path.basename(entries[name].file)} and {fname}"
                )
            entries[name] = e
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name not in entries or os.path.basename(entries[name].file) != fname:
                raise ConvertError(
                    f"{INDEX} maps tensor {name!r} to {fname}, but that file's header "
                    "does not hold it (corrupt or mismatched shard)"
                )
    prefix = P.HF_PREFIX if any(n.startswith(P.HF_PREFIX) for n in entries) else ""
    return Source(hf_dir, cfg, entries, files, prefix)


def check(src: Source, table: list[P.TensorSpec]) -> dict[str, int]:
    """Validate names, dtypes and shapes of every table entry; returns skipped-tensor counts by kind."""
    used: set[str] = set()
    missing = []
    for spec in table:
        for tname in spec.hf_names:
            name = src.name(tname)
            if name not in src.entries:
                missing.append(name)
                continue
            used.add(name)
            _check_one(spec, src.entries[name], name)
            if spec.transform == "dequant":
                sname = name.removesuffix("_packed") + "_scale"
                if sname not in src.entries:
                    missing.append(sname)
                    continue
                used.add(sname)
                s = src.entries[sname]
                out, half = spec.hf_shape
                want = (out, 2 * half // 32)
                if s.dtype != "U8" or s.shape != want:
                    raise ConvertError(
                        f"tensor {sname!r} in {_f(s)}: {s.dtype}{list(s.shape)}, expected "
                        f"U8{list(want)} (E8M0 scales, one per 32 weights)"
                    )
    if missing:
        where = ", ".join(repr(m) for m in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ConvertError(f"missing tensors (not in any shard of {src.hf_dir}): {where}")
    skipped: dict[str, int] = {}
    unexpected = []
    for name, e in src.entries.items():
        if name in used:
            continue
        kind = next((p.rstrip(".") for p in SKIP_PREFIXES if name.startswith(p)), None)
        kind = kind or next((s for s in SKIP_SUFFIXES if name.endswith(s)), None)
        if kind is None:
            unexpected.append(f"{name!r} (in {_f(e)})")
        else:
            skipped[kind] = skipped.get(kind, 0) + 1
    if unexpected:
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        hint = ""
        if any(".weight" in u and "experts." in u and "_packed" not in u for u in unexpected):
            hint = " (bf16 experts in a checkpoint whose config declares MXFP4, or the reverse?)"
        raise ConvertError(f"unexpected tensors not in the K3 tensor table: {', '.join(unexpected[:5])}{more}{hint}")
    src.skipped = skipped
    return skipped


def _f(e: Entry) -> str:
    return os.path.basename(e.file)


def _check_one(spec: P.TensorSpec, e: Entry, name: str):
    packed = spec.dtype == "uint8" or spec.transform == "dequant"
    ok_dtypes = ("U8",) if packed else FLOAT_DTYPES
    if e.dtype not in ok_dtypes:
        what = "packed MXFP4 bytes" if packed else "a float tensor"
        raise ConvertError(
            f"tensor {name!r} in {_f(e)}: dtype {e.dtype}, expected {what} ({'/'.join(ok_dtypes)})"
            + (" - unknown quantization format?" if packed or e.dtype in ("I32", "I8") else "")
        )
    if not shape_ok(spec, e.shape):
        raise ConvertError(f"tensor {name!r} in {_f(e)}: shape {list(e.shape)}, expected {list(spec.hf_shape)}")


def shape_ok(spec: P.TensorSpec, shape: tuple[int, ...]) -> bool:
    if tuple(shape) == tuple(spec.hf_shape):
        return True
    if spec.transform == "narrow":  # A_log: stored entries (128) or exactly the heads, any unit axes
        n = math.prod(shape)
        return _squeeze(shape) in ((n,),) and n in (math.prod(spec.hf_shape), spec.shape[-1])
    if spec.transform == "reshape" or (spec.transform == "copy" and len(spec.hf_shape) == 1):
        return _squeeze(shape) == _squeeze(spec.hf_shape)  # [1, D] vs [D], [d, 1, 4] vs [d, 4]
    return False


def _squeeze(shape) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def fingerprint(path: str, full: bool = False) -> str:
    """sha256 of the whole file (`full`) or a fast fingerprint: size, header and 16 sampled 1 MiB windows
    (hashing 1.4 TB in full takes ~25 min of CPU on 2 cores; the fast form catches a swapped shard)."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        if full:
            while chunk := f.read(16 << 20):
                h.update(chunk)
            return "sha256:" + h.hexdigest()
        win = 1 << 20
        for i in range(17):
            f.seek(min(size - win, i * size // 16) if size > win else 0)
            h.update(f.read(win))
    return "fast-sha256:" + h.hexdigest()
