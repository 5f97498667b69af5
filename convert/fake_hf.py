"""Write K3-format HF checkpoints from a config and a seed (tests, the demo model, throughput runs).

The release's conventions: wrapper config.json (`kimi_k3` -> `text_config` with its `quantization_config`),
`model.safetensors.index.json` + several shards, `language_model.model.*` names and
`language_model.lm_head.weight`, MXFP4 experts as uint8 `weight_packed`/`weight_scale`, `A_log` padded to
128, conv weights `[d, 1, 4]`, AttnRes projections `[1, D]`. Values come from `params.init_tensor` mapped
through `transforms.to_hf`, so converting the result gives back exactly `params.init_params(cfg, seed)`.
Tensors are generated one table entry at a time and streamed into the shards, so multi-GB checkpoints
need little memory. Variants that other tools may write (bf16 small tensors, 4-D A_log, a single
`model.safetensors`, a bare `kimi_linear` config, eos as a list) are options, to exercise the converter.

    python -m convert.fake_hf OUT_DIR --preset tiny --seed 0 --shards 3 [--vision] [--tokenizer]
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os

import jax
import numpy as np

from convert.safetensors_io import ST_NAME, Writer
from k3jax import params as P
from k3jax import transforms
from k3jax.config import K3Config, load_config

# Real K3 structure and tensor names (93 layers, AttnRes blocks of 12, the release's layer pattern, full
# vocabulary) at reduced widths: ~3.5 GB, for the conversion throughput measurement.
K3_NARROW = dict(
    hidden_size=512,
    intermediate_size=2048,
    num_attention_heads=8,
    num_key_value_heads=8,
    kda_num_heads=8,
    kda_head_dim=64,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    num_experts=64,
    num_experts_per_token=4,
    moe_intermediate_size=512,
    routed_expert_hidden_size=512,
    num_shared_experts=1,
)


def fake_config(name: str, **overrides) -> K3Config:
    if name == "k3-narrow":
        return load_config("k3").replace(name="k3-narrow", **{**K3_NARROW, **overrides})
    return load_config(name).replace(**overrides) if overrides else load_config(name)


def _hf_entries(cfg: K3Config, small_dtype: str, a_log_4d: bool, prefix: str):
    """[(spec, [(name, st_dtype, shape)])] in table order; kv_b is emitted once, from the w_uk entry."""
    out = []
    for spec in P.tensor_table(cfg):
        if spec.transform == "kvb_v":
            continue
        dt = spec.hf_dtypes[0]
        if spec.dtype == "float32" and "bfloat16" in spec.hf_dtypes:
            dt = small_dtype
        shape = spec.hf_shape
        if spec.transform == "narrow" and a_log_4d:
            shape = (1, 1, math.prod(shape), 1)
        names = [prefix + n.removeprefix(P.HF_PREFIX) for n in spec.hf_names]
        out.append((spec, [(n, ST_NAME[dt], shape) for n in names]))
    return out


def _vision_entries():
    """A few multimodal-wrapper tensors the converter must skip (and count)."""
    return [
        ("vision_tower.patch_embed.proj.weight", "BF16", (32, 3, 2, 2)),
        ("vision_tower.blocks.0.attn.qkv.weight", "BF16", (96, 32)),
        ("mm_projector.proj.0.weight", "BF16", (64, 32)),
        ("mm_projector.proj.2.weight", "BF16", (64, 64)),
    ]


def _generate(spec, table_by_path, key, shapes):
    """HF arrays for one table entry (generated on the fly, not kept)."""
    ours = np.asarray(jax.device_get(P.init_tensor(spec, key)))
    other = None
    if spec.transform == "kvb_k":
        uv = table_by_path[spec.path[:-1] + ("w_uv",)]
        other = np.asarray(jax.device_get(P.init_tensor(uv, key)))
    arrs = transforms.to_hf(spec, ours, other)
    return [a.astype(_np(dt)).reshape(shape) for a, (_, dt, shape) in zip(arrs, shapes, strict=True)]


def _np(st_dtype):
    from convert.safetensors_io import DTYPES

    return DTYPES[st_dtype]


def write_fake_hf(
    out_dir: str,
    cfg: K3Config,
    seed: int = 0,
    shards: int = 3,
    *,
    vision: bool = False,
    tokenizer: bool = False,
    small_dtype: str = "float32",
    a_log_4d: bool = False,
    single_file: bool = False,
    bare_config: bool = False,
    eos_list: bool = False,
    progress: bool = False,
) -> dict:
    """Write the checkpoint; returns {'bytes': total tensor bytes, 'tensors': count, 'files': [...]}."""
    os.makedirs(out_dir, exist_ok=True)
    prefix = "" if bare_config else P.HF_PREFIX
    entries = _hf_entries(cfg, small_dtype, a_log_4d, prefix)
    table_by_path = {s.path: s for s in P.tensor_table(cfg)}
    key = jax.random.key(seed)

    def nbytes(names):
        return sum(math.prod(s) * np.dtype(_np(d)).itemsize for _, d, s in names)

    total = sum(nbytes(n) for _, n in entries) + (nbytes(_vision_entries()) if vision else 0)
    # consecutive table entries fill shards of ~equal size (an entry never straddles two shards)
    shards = 1 if single_file else max(1, min(shards, len(entries)))
    groups: list[list] = [[] for _ in range(shards)]
    acc = 0
    for spec, names in entries:
        groups[min(shards - 1, int(acc * shards / max(total, 1)))].append((spec, names))
        acc += nbytes(names)
    groups = [g for g in groups if g]
    files = (
        ["model.safetensors"]
        if single_file
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    weight_map = {}
    bar = _bar(total, progress)
    for gi, (fname, group) in enumerate(zip(files, groups, strict=True)):
        decl = {n: (d, s) for _, names in group for n, d, s in names}
        extra = _vision_entries() if vision and gi == len(groups) - 1 else []
        decl.update({n: (d, s) for n, d, s in extra})
        w = Writer(os.path.join(out_dir, fname), decl, metadata={"format": "pt"})
        for spec, names in group:
            for (n, _, _), arr in zip(names, _generate(spec, table_by_path, key, names), strict=True):
                w.write(n, arr)
                bar.update(arr.nbytes)
        rng = np.random.default_rng(seed)
        for n, d, s in extra:
            w.write(n, rng.standard_normal(s).astype(_np(d)))
        w.close()
        weight_map.update(dict.fromkeys(decl, fname))
    bar.close()
    if not single_file:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    conf = cfg.to_hf(wrapped=not bare_config)
    if eos_list:
        conf["eos_token_id"] = [cfg.eos_token_id]
        conf.get("text_config", conf)["eos_token_id"] = [cfg.eos_token_id]
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(conf, f, indent=2)
    if tokenizer:
        write_tokenizer(out_dir, cfg)
    return {"bytes": total, "tensors": len(weight_map), "files": files}


def write_tokenizer(out_dir: str, cfg: K3Config):
    """A small tiktoken BPE (256 byte tokens + merges up to bos_token_id) and its tokenizer_config.json
    (special ids bos_token_id..vocab_size-1, as the release reserves 163584..163839)."""
    n_ranks = cfg.bos_token_id
    ranks = [bytes([i]) for i in range(256)]
    text = b"the quick brown fox jumps over the lazy dog and then the cat sat on the mat " * 4
    while len(ranks) < n_ranks:  # greedy merges of the most frequent adjacent pair of the sample text
        toks = _bpe(text, {t: i for i, t in enumerate(ranks)})
        pairs: dict[bytes, int] = {}
        for a, b in zip(toks, toks[1:], strict=False):
            pairs[a + b] = pairs.get(a + b, 0) + 1
        new = [p for p, _ in sorted(pairs.items(), key=lambda kv: -kv[1]) if p not in ranks]
        if not new:
            break
        ranks.append(new[0])
    while len(ranks) < n_ranks:  # pad with unused two-byte tokens so special ids keep their release offset
        ranks.append(bytes([0xFF, len(ranks) % 256, len(ranks) // 256 % 256]))
    with open(os.path.join(out_dir, "tiktoken.model"), "w") as f:
        for i, t in enumerate(ranks):
            f.write(f"{base64.b64encode(t).decode()} {i}\n")
    names = {
        cfg.bos_token_id: "[BOS]",
        cfg.bos_token_id + 1: "[EOS]",
        cfg.eos_token_id: "<|end_of_msg|>",
        cfg.bos_token_id + 3: "<|open|>",
        cfg.bos_token_id + 4: "<|close|>",
        cfg.bos_token_id + 5: "<|sep|>",
        cfg.pad_token_id: "[PAD]",
    }
    added = {
        str(i): {"content": names.get(i, f"<|reserved_token_{i}|>"), "special": True}
        for i in range(cfg.bos_token_id, cfg.vocab_size)
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "added_tokens_decoder": added,
                "bos_token": "[BOS]",
                "eos_token": "<|end_of_msg|>",
                "pad_token": "[PAD]",
                "tokenizer_class": "TikTokenTokenizer",
            },
            f,
            indent=1,
        )


def _bpe(text: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    parts = [text[i : i + 1] for i in range(len(text))]
    while True:
        best = min(
            ((ranks.get(parts[i] + parts[i + 1], 1 << 30), i) for i in range(len(parts) - 1)),
            default=(1 << 30, -1),
        )
        if best[0] == 1 << 30:
            return parts
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def _bar(total, on):
    if not on:

        class _Null:
            def update(self, n):
                pass

            def close(self):
                pass

        return _Null()
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="fake HF")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m convert.fake_hf", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--preset", default="tiny", help="tiny | demo | k3 | k3-narrow")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a K3Config field (JSON value), e.g. --set num_hidden_layers=12",
    )
    ap.add_argument("--vision", action="store_true", help="also write vision_tower/mm_projector tensors")
    ap.add_argument("--tokenizer", action="store_true", help="also write tiktoken.model + tokenizer_config.json")
    ap.add_argument(
        "--small-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of A_log/dt_bias/conv/o_norm/router bias (the release: float32)",
    )
    ap.add_argument("--a-log-4d", action="store_true", help="store A_log as (1, 1, 128, 1)")
    ap.add_argument("--single-file", action="store_true", help="one model.safetensors, no index")
    ap.add_argument("--bf16-experts", action="store_true", help="unquantised experts (no quantization_config)")
    a = ap.parse_args(argv)
    over = {k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)}
    if a.bf16_experts:
        over["expert_quant"] = None
    cfg = fake_config(a.preset, **over)
    info = write_fake_hf(
        a.out_dir,
        cfg,
        a.seed,
        a.shards,
        vision=a.vision,
        tokenizer=a.tokenizer,
        small_dtype=a.small_dtype,
        a_log_4d=a.a_log_4d,
        single_file=a.single_file,
        progress=True,
    )
    print(
        f"wrote {info['tensors']} tensors, {info['bytes'] / 1e6:.1f} MB in {len(info['files'])} file(s) to {a.out_dir}"
    )


if __name__ == "__main__":
    main()
