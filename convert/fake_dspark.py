"""Write a tiny DSpark drafter checkpoint (config.json + model.safetensors, docs/model.md §9.2 names) matching a target.

The drafter's hidden and vocab sizes are the target's (it shares the target's embedding and lm_head); its
RoPE width is the target's qk_rope_head_dim; the tap ids are spread over the target's layers the way the
release spreads [2, 23, 47, 71, 89] over 93. Values come from drafter_params.init_params(seed), so loading
the result gives back exactly those parameters.

    python -m convert.fake_dspark OUT_DIR --target tiny --seed 0
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import numpy as np

from convert.safetensors_io import ST_NAME, Writer
from k3jax import drafter_params as DP
from k3jax.config import K3Config, load_config


def tiny_dspark_config(
    target: K3Config, num_layers: int = 2, heads: int = 4, num_taps: int = 5, **overrides
) -> DP.DSparkConfig:
    L = target.num_hidden_layers
    taps = tuple(sorted({int(round(x)) for x in np.linspace(1, L - 1, num_taps)}))
    kw = dict(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=2 * target.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=target.qk_rope_head_dim,
        v_head_dim=16,
        rope_original_max_position_embeddings=256,
        max_position_embeddings=target.max_position_embeddings,
        target_layer_ids=taps,
        target_hidden_size=target.hidden_size,
        target_num_hidden_layers=L,
        mask_token_id=target.vocab_size - 3,
        markov_rank=16,
        bos_token_id=target.bos_token_id,
        eos_token_id=target.eos_token_id,
        pad_token_id=target.pad_token_id,
    )
    return DP.DSparkConfig(**(kw | overrides))


def write_fake_dspark(out_dir: str, c: DP.DSparkConfig, seed: int = 0, target_embed=None) -> dict:
    """Returns our params (as written). target_embed [V, D]: written as embed_tokens.weight, as released."""
    os.makedirs(out_dir, exist_ok=True)
    params = DP.init_params(c, seed)
    flat = {s.path: np.asarray(jax.device_get(_get(params, s.path))) for s in DP.tensor_table(c)}
    hf = DP.params_to_hf(flat, c)
    if target_embed is not None:
        hf["embed_tokens.weight"] = np.asarray(target_embed)
    w = Writer(
        os.path.join(out_dir, "model.safetensors"), {k: (ST_NAME[str(v.dtype)], tuple(v.shape)) for k, v in hf.items()}
    )
    for k, v in hf.items():
        w.write(k, v)
    w.close()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(c.to_hf(), f, indent=2)
    return params


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m convert.fake_dspark", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--target", default="tiny", help="target preset or config.json path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    a = ap.parse_args(argv)
    c = tiny_dspark_config(load_config(a.target), a.layers, a.heads)
    write_fake_dspark(a.out_dir, c, a.seed)
    print(f"wrote a {c.num_hidden_layers}-layer DSpark drafter, taps {list(c.target_layer_ids)}: {a.out_dir}")


if __name__ == "__main__":
    main()
