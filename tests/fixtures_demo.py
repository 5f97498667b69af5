"""One converted 'tiny' checkpoint per test session, shared by the engine / tokenizer / generate-CLI tests.

Made the way a user makes one: convert/fake_hf.py writes an HF directory (random weights, tiktoken.model,
tokenizer_config.json) and the real converter turns it into a k3jax checkpoint. Building it costs ~15 s of CPU,
so the result is memoised per process (a session fixture imported into several test modules gets one
FixtureDef per module; the memo makes sure it is still built only once). Next to it: the same HF tensors
converted WITHOUT tokenizer files, for the "text prompt needs a tokenizer" refusals.
"""

import os
from dataclasses import dataclass

import numpy as np
import pytest

from convert.core import Options, convert
from convert.fake_hf import write_fake_hf
from k3jax.config import K3Config, preset
from k3jax.tokenizer import FILES as TOKENIZER_FILES


@dataclass(frozen=True)
class TinyCheckpoint:
    cfg: K3Config
    seed: int
    hf: str  # the HF directory (not converted: the CLI must refuse it)
    ckpt: str  # converted, with tokenizer files
    ckpt_no_tok: str  # converted from the same tensors without tokenizer files


_MEMO: dict[str, TinyCheckpoint] = {}


def build(root: str) -> TinyCheckpoint:
    cfg = preset("tiny")
    seed = int(np.random.default_rng().integers(1 << 30))
    print(f"tiny checkpoint seed {seed}")
    hf, ckpt, bare, ckpt_no_tok = (os.path.join(root, n) for n in ("hf", "ckpt", "hf_no_tok", "ckpt_no_tok"))
    write_fake_hf(hf, cfg, seed, shards=2, tokenizer=True)
    convert(hf, ckpt, Options(progress=False))
    os.makedirs(bare)
    for name in os.listdir(hf):  # the same HF files minus the tokenizer (symlinks: no copy, no regeneration)
        if name not in TOKENIZER_FILES:
            os.symlink(os.path.join(hf, name), os.path.join(bare, name))
    convert(bare, ckpt_no_tok, Options(progress=False))
    return TinyCheckpoint(cfg, seed, hf, ckpt, ckpt_no_tok)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> TinyCheckpoint:
    if "tiny" not in _MEMO:
        _MEMO["tiny"] = build(str(tmp_path_factory.mktemp("tiny_ckpt")))
    return _MEMO["tiny"]
