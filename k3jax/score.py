"""Full-sequence logits: `python -m k3jax.score --checkpoint CKPT --tokens IDS.npy --out OUT.npy`.

IDS.npy holds int token ids [B, T] (or [T]); OUT.npy gets float32 logits [B, T, V] (or [T, V]) from
`model.forward` (causal, from an empty state). With --dtype float32 the bf16 trunk is widened exactly and
every matmul runs at full fp32 precision (jax_default_matmul_precision="highest"), for comparisons with
independent implementations; --dtype bfloat16 is the model's native numerics.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def score(ckpt_dir: str, tokens: np.ndarray, dtype: str = "float32", mesh=None, verify: bool = False) -> np.ndarray:
    import jax
    import jax.numpy as jnp

    from k3jax import model
    from k3jax.checkpoint import load

    if dtype == "float32":
        jax.config.update("jax_default_matmul_precision", "highest")
    tokens = np.asarray(tokens)
    if not np.issubdtype(tokens.dtype, np.integer) or tokens.ndim not in (1, 2):
        raise ValueError(f"tokens must be int ids of shape [B, T] or [T], got {tokens.dtype}{list(tokens.shape)}")
    dt = jnp.dtype(dtype)
    cfg, params = load(ckpt_dir, mesh=mesh, dtype=dt, verify=verify)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.vocab_size):
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size}); got [{tokens.min()}, {tokens.max()}]")
    ids_BT = tokens[None] if tokens.ndim == 1 else tokens
    fwd = jax.jit(model.forward, static_argnums=(2, 3))
    logits = np.asarray(fwd(params, jnp.asarray(ids_BT, jnp.int32), cfg, dt), np.float32)
    return logits[0] if tokens.ndim == 1 else logits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3jax.score", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a k3jax-convert output directory")
    ap.add_argument("--tokens", required=True, help=".npy of int token ids [B, T] or [T]")
    ap.add_argument("--out", required=True, help=".npy to write float32 logits to")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument(
        "--verify-checkpoint",
        action="store_true",
        help="check every checkpoint file's checksum before loading (a full read; sizes are always checked)",
    )
    ap.add_argument("--verbose", action="store_true", help="library logs and full tracebacks on the terminal")
    a = ap.parse_args(argv)

    def run() -> int:
        logits = score(a.checkpoint, _load_tokens(a.tokens), a.dtype, verify=a.verify_checkpoint)
        np.save(a.out, logits)
        print(f"wrote logits {list(logits.shape)} to {a.out}")
        return 0

    from k3jax import errors

    return errors.cli_main("k3jax.score", run, verbose=a.verbose)


def _load_tokens(path: str) -> np.ndarray:
    try:
        return np.load(path)
    except (OSError, ValueError) as e:  # missing file, or not an .npy (np.load would try to unpickle it)
        raise ValueError(f"--tokens {path}: cannot read an .npy of token ids ({e})") from None


if __name__ == "__main__":
    sys.exit(main())
