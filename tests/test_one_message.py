"""A refusal is one clear last line on stderr, not tens of thousands of lines of orbax / asyncio tracebacks: the
details go to a log file the message names, or to the terminal with --verbose."""

import glob
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from fixtures_demo import tiny_ckpt  # noqa: F401  (session fixture)

from convert import __main__ as convert_cli
from k3jax import errors, plan
from k3jax import manifest as M

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = 20  # lines: what "one clear message" may cost on stderr at most

# orbax's failure mode, reproduced without depending on its timing: one read fails, and asyncio.run's shutdown
# then logs every other read that raised on cancellation instead of being cancelled (each with a traceback and,
# in orbax's case, a page of TensorStore spec). A checkpoint missing one chunk file printed ~40k lines this way.
FLOOD = textwrap.dedent("""
    import asyncio, sys
    import orbax.checkpoint as ocp
    from k3jax import checkpoint, generate

    N = int(sys.argv[1])

    def restore(self, directory, target):
        async def read(i):
            try:
                await asyncio.sleep(0 if i == 0 else 60)
            except asyncio.CancelledError:
                raise ValueError(f"Encountered error while reading array index {i}:" + " spec" * 100) from None
            raise ValueError("NOT_FOUND: chunk {3, 0, 0} stored at local file 'x/3.0.0' is missing. "
                             "See full TensorStore details")

        async def main():
            await asyncio.gather(*(read(i) for i in range(N)))

        asyncio.run(main())

    ocp.StandardCheckpointer.restore = restore
    sys.exit(generate.main(sys.argv[2:]))
""")


def _run(args, tmp_path, **kw):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", errors.LOG_DIR_ENV: str(tmp_path / "logs")}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, **kw)


def test_orbax_flood_is_one_line_and_a_log_file(tiny_ckpt, tmp_path, rng):  # noqa: F811
    n = int(rng.integers(200, 400))
    argv = [sys.executable, "-c", FLOOD, str(n), "--checkpoint", tiny_ckpt.ckpt, "--prompt-ids", "1,2"]
    loud = _run([*argv, "--verbose"], tmp_path)  # --verbose: what users used to get
    assert loud.returncode == 2 and loud.stderr.count("unhandled exception during asyncio.run() shutdown") == n - 1
    p = _run(argv, tmp_path)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and 1 <= len(lines) < SHORT, p.stderr[-3000:]
    assert lines[-1].startswith("error: ") and "missing or corrupt" in lines[-1] and "k3jax-convert" in lines[-1]
    log = re.search(r"orbax's log: (\S+?)\)", lines[-1])[1]
    with open(log) as f:
        text = f.read()
    assert text.count("unhandled exception during asyncio.run() shutdown") == n - 1 and "3.0.0" in text


def test_damaged_checkpoint_refusals_are_short(tiny_ckpt, tmp_path, rng):  # noqa: F811
    """The real thing, end to end: generate and score on a checkpoint with one chunk file removed."""
    d = str(tmp_path / "ck")
    shutil.copytree(tiny_ckpt.ckpt, d)
    chunks = sorted(p for p in glob.glob(os.path.join(d, "params", "*", "*")) if not p.endswith(M.ZARRAY))
    gone = chunks[int(rng.integers(len(chunks)))]
    os.remove(gone)
    np.save(tmp_path / "ids.npy", rng.integers(0, 200, (1, 4)))
    for args in (
        ["-m", "k3jax.generate", "--checkpoint", d, "--prompt-ids", "1,2", "--max-new-tokens", "2"],
        ["-m", "k3jax.score", "--checkpoint", d, "--tokens", str(tmp_path / "ids.npy"), "--out", str(tmp_path / "o")],
    ):
        p = _run([sys.executable, *args], tmp_path)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and 1 <= len(lines) < SHORT, p.stderr[-3000:]
        assert "missing or corrupt" in lines[-1] and os.path.relpath(gone, d) in lines[-1], lines[-1]


def test_plan_and_convert_refusals_are_one_line(tiny_ckpt, tmp_path, capsys):  # noqa: F811
    assert plan.main(["--config", "k3", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3jax.plan: error: ") and len(err.splitlines()) == 1, err
    assert plan.main(["--config", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3jax.plan: error: ") and len(err.splitlines()) == 1, err
    assert convert_cli.main([tiny_ckpt.ckpt, str(tmp_path / "o"), "--no-progress"]) == 2  # not an HF checkpoint
    err = capsys.readouterr().err
    assert err.startswith("k3jax-convert: error: ") and len(err.splitlines()) == 1, err
    assert convert_cli.main(["--check", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3jax-convert: error: ") and "no such directory" in err and len(err.splitlines()) == 1


def test_unexpected_errors_name_a_log_file(tmp_path, monkeypatch, capsys, rng):
    monkeypatch.setenv(errors.LOG_DIR_ENV, str(tmp_path / "logs"))
    word = f"w{rng.integers(1 << 30)}"

    def bug():
        raise KeyError(word)

    assert errors.cli_main("prog", bug) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("prog: error: unexpected KeyError") and "--verbose" in err
    log = re.search(r"the traceback is in (\S+?);", err)[1]
    with open(log) as f:
        assert "Traceback" in f.read() and word in err
    with pytest.raises(KeyError):
        errors.cli_main("prog", bug, verbose=True)
    page = "\n".join(f"line {i} of someone else's ValueError {word}" for i in range(int(rng.integers(10, 400))))

    def long_refusal():
        raise ValueError(page)

    assert errors.cli_main("prog", long_refusal) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "line 0 of" in err and "the whole message is in" in err
    with open(re.search(r"the whole message is in (\S+?)\)", err)[1]) as f:
        assert page in f.read()
