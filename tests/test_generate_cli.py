"""`python -m k3jax.generate` in-process: the issue's done-when check against `python -m k3jax.score`, every
bad input refused up front (exit 2, a clear message, no weights read, nothing generated), and once as a new
user would run it (a subprocess with no --checkpoint: the embedded demo, made in a fresh cache directory).
"""

import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from fixtures_demo import tiny_ckpt  # noqa: F401  (session fixture)
from helpers import assert_cli_refused, near_tie

from k3jax import checkpoint, generate, score
from k3jax.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_greedy_prompt_ids_match_score_argmax(tiny_ckpt, tmp_path, capsys, rng):  # noqa: F811
    """Done-when: greedy --prompt-ids output == argmax of `k3jax.score` full-sequence logits at every generated
    position (float32 compute, bf16 cache); 64 sequences (the slot limit) in one batch."""
    cfg, ck = tiny_ckpt.cfg, tiny_ckpt.ckpt
    ids = rng.integers(0, cfg.vocab_size, size=int(rng.integers(2, 20))).tolist()
    n = int(rng.integers(8, 20))
    rc = generate.main(
        [
            "--checkpoint",
            ck,
            "--prompt-ids",
            ",".join(map(str, ids)),
            "--greedy",
            "--dtype",
            "float32",
            "--cache-dtype",
            "bf16",
            "--max-new-tokens",
            str(n),
            "--batch",
            "64",
            "--json",
        ]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err
    res = json.loads(out.out.splitlines()[-1])  # one JSON line (the rng fixture printed its seed before it)
    gen = res["generated_ids"]
    assert res["prompt_ids"] == ids and len(gen) == 64 and all(g == gen[0] for g in gen)
    tok = Tokenizer.from_dir(ck)
    g = gen[0]
    assert len(g) == n or (len(g) < n and g[-1] in tok.stop_ids)
    assert all(t not in tok.stop_ids for t in g[:-1])
    assert res["text"][0] == tok.decode(g)
    assert res["decode_tokens"] == 64 * (len(g) - 1) and res["ttft_s"] > 0
    assert len(g) == 1 or res["decode_tokens_per_s"] > 0
    np.save(tmp_path / "ids.npy", np.array(ids + g[:-1]))
    assert (
        score.main(["--checkpoint", ck, "--tokens", str(tmp_path / "ids.npy"), "--out", str(tmp_path / "lg.npy")]) == 0
    )
    logits = np.load(tmp_path / "lg.npy")
    lg = logits[len(ids) - 1 :]
    clear = ~near_tie(lg)  # teacher forcing: each position stands alone; near-ties may go either way in fp32
    np.testing.assert_array_equal(lg.argmax(-1)[clear], np.asarray(g)[clear])


@pytest.fixture
def no_weights(monkeypatch):
    """A refusal must come before any weight is read or any token generated."""

    def boom(*a, **k):
        raise AssertionError("weights were loaded before the request was refused")

    monkeypatch.setattr(checkpoint, "load", boom)


BAD = [
    (["--prompt", ""], "prompt is empty"),
    (["--prompt-ids", ""], "prompt 0 is empty"),
    (["--prompt-ids", "1,2,x"], "comma-separated integers"),
    (["--prompt-ids", ",".join(["7"] * 30), "--max-len", "32"], "cache holds 32"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["--prompt-ids", "1,512"], "outside [0, 512)"),
    (["--prompt", "hi", "--temperature", "-0.5"], "temperature must be >= 0"),
    (["--prompt", "hi", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["--prompt", "hi", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--prompt", "hi", "--top-k", "-2"], "top_k must be >= 0"),
    (["--prompt", "hi", "--batch", "65"], "--batch must be in 1..64"),
    (["--prompt", "hi", "--batch", "0"], "--batch must be in 1..64"),
    (["--prompt", "hi", "--max-len", "100000"], "max_position_embeddings"),
    (["--prompt", "hi", "--spec", "dspark"], "--draft-checkpoint"),
]


@pytest.mark.parametrize("argv,msg", BAD, ids=[m for _, m in BAD])
def test_bad_input_refused_up_front(tiny_ckpt, no_weights, capsys, argv, msg):  # noqa: F811
    assert_cli_refused(capsys, ["--checkpoint", tiny_ckpt.ckpt, *argv, "--json"], msg)


def test_bad_checkpoints_refused(tiny_ckpt, no_weights, tmp_path, capsys):  # noqa: F811
    assert_cli_refused(capsys, ["--checkpoint", tiny_ckpt.hf, "--prompt-ids", "1,2"], "looks like an HF checkpoint")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "weights.bin").write_bytes(os.urandom(64))
    assert_cli_refused(
        capsys, ["--checkpoint", str(tmp_path / "junk"), "--prompt", "hi"], "not a converted k3jax checkpoint"
    )
    assert_cli_refused(capsys, ["--checkpoint", str(tmp_path / "missing"), "--prompt", "hi"], "no such directory")
    # converted without tokenizer files: a text prompt is refused and --prompt-ids is named as the way out
    assert_cli_refused(capsys, ["--checkpoint", tiny_ckpt.ckpt_no_tok, "--prompt", "hello"], "tiktoken.model")
    assert_cli_refused(capsys, ["--checkpoint", tiny_ckpt.ckpt_no_tok, "--prompt", "hello"], "--prompt-ids")


def test_empty_stdin_is_no_prompt(tiny_ckpt, no_weights, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert_cli_refused(capsys, ["--checkpoint", tiny_ckpt.ckpt], "no prompt")


def test_readme_demo_command_as_a_new_user(tmp_path):
    """The README's "run the main job" command, with an empty cache directory: it makes the demo model through
    fake_hf + the real converter, says plainly that the weights are random, and generates."""
    env = {**os.environ, "K3JAX_CACHE": str(tmp_path / "cache")}
    p = subprocess.run(
        [sys.executable, "-m", "k3jax.generate", "--prompt", "the quick brown fox", "--max-new-tokens", "24"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "RANDOM weights" in p.stdout and str(tmp_path / "cache") in p.stdout
    m = re.search(r"sequence 0: (\d+) tokens", p.stdout)
    assert m and 1 <= int(m.group(1)) <= 24, p.stdout
    assert re.search(r"decode [\d.]+ tokens/s", p.stdout), p.stdout
    made = [d for d in os.listdir(tmp_path / "cache") if d.startswith("demo-")]
    assert len(made) == 1 and os.path.exists(tmp_path / "cache" / made[0] / "tiktoken.model")
