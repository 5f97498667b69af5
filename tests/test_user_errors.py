"""A first-time user's bad input: each case is refused up front with a message that says what to do, and loses
nothing. CLI refusals must come before any weight is read (checkpoint.load is replaced by a bomb)."""

import glob
import os
import re
import shutil

import numpy as np
import pytest
from fixtures_demo import tiny_ckpt  # noqa: F401  (session fixture)
from helpers import assert_cli_refused

from convert import __main__ as convert_cli
from convert.core import Options, convert
from convert.fake_dspark import tiny_dspark_config, write_fake_dspark
from convert.source import ConvertError
from k3jax import checkpoint, config, distributed, sampling, sharding
from k3jax import params as P
from k3jax.checkpoint import CheckpointError
from k3jax.config import ConfigError, preset

QUIET = Options(progress=False, workers=2)


@pytest.fixture
def hf_dir(tiny_ckpt):  # noqa: F811  (the session's shared tiny checkpoint: no conversion of our own)
    return tiny_ckpt.hf


@pytest.fixture
def ckpt(tiny_ckpt):  # noqa: F811
    return tiny_ckpt.ckpt


@pytest.fixture
def no_weights(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("weights were loaded before the request was refused")

    monkeypatch.setattr(checkpoint, "load", boom)


def _flags(rng):
    """Random values for the flags a case does not care about, so no case passes by a lucky default."""
    return [
        "--prompt-ids",
        ",".join(map(str, rng.integers(0, 256, int(rng.integers(1, 6))))),
        "--max-new-tokens",
        str(int(rng.integers(1, 9))),
    ]


BAD = [
    (["--tp", "0"], "--tp must be >= 1"),
    (["--tp", "-2"], "--tp must be >= 1"),
    (["--temperature", "inf"], "finite"),
    (["--top-p", "0.5"], "add --temperature"),
    (["--top-k", "5"], "add --temperature"),
    (["--greedy", "--temperature", "0.7"], "--greedy contradicts"),
    (["--num-draft", "3"], "add --spec"),
    (["--acceptance-length", "3"], "add --spec"),
    (["--draft-checkpoint", "/x"], "add --spec"),
    (["--spec", "ngram", "--acceptance-length", "3"], "only used by --spec synthetic"),
    (["--spec", "synthetic", "--draft-checkpoint", "/x"], "only used by --spec dspark"),
    (["--spec", "dspark", "--draft-checkpoint", "/nonexistent/dspark"], "no such directory"),
    (["--spec", "ngram", "--max-len", "8"], "positions a speculative step writes ahead"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file /nonexistent/prompt.txt"),
    (["--num-processes", "2"], "needs --coordinator"),
    (["--process-id", "1"], "needs --coordinator"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"], "--process-id must be in 0..1"),
]


@pytest.mark.parametrize("argv,msg", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_cli_refuses_up_front(ckpt, no_weights, capsys, monkeypatch, rng, argv, msg):
    for v in (
        "JAX_COORDINATOR_ADDRESS",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
        "SLURM_JOB_ID",
        "OMPI_MCA_orte_hnp_uri",
        "OMPI_COMM_WORLD_SIZE",
    ):
        monkeypatch.delenv(v, raising=False)
    base = _flags(rng)
    if "--prompt-file" in argv:
        base = base[2:]  # the prompt flags are mutually exclusive
    assert_cli_refused(capsys, ["--checkpoint", ckpt, *base, *argv], msg)


def test_dspark_drafter_for_another_target_refused(ckpt, no_weights, capsys, tmp_path, rng):
    """A drafter whose hidden size differs from the target's used to fail inside jit with an einsum error."""
    target = checkpoint.load_config(ckpt)
    hidden = int(rng.choice([32, 96, 256]))
    d = str(tmp_path / "dspark")
    write_fake_dspark(d, tiny_dspark_config(target.replace(hidden_size=hidden)), seed=int(rng.integers(1 << 20)))
    assert_cli_refused(
        capsys,
        ["--checkpoint", ckpt, *_flags(rng), "--spec", "dspark", "--draft-checkpoint", d],
        f"hidden_size={hidden} (target: {target.hidden_size})",
    )


def test_sampling_params_refuse_non_finite(rng):
    with pytest.raises(sampling.SamplingError, match="finite"):
        sampling.SamplingParams(temperature=float(rng.choice([np.inf, np.nan])))
    sampling.SamplingParams(temperature=float(rng.uniform(0.1, 2)))  # finite positive is fine


def test_distributed_needs_a_coordinator(monkeypatch, rng):
    for v in (
        "JAX_COORDINATOR_ADDRESS",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
        "SLURM_JOB_ID",
        "OMPI_MCA_orte_hnp_uri",
        "OMPI_COMM_WORLD_SIZE",
    ):
        monkeypatch.delenv(v, raising=False)
    n = int(rng.integers(2, 9))
    with pytest.raises(ValueError, match="--coordinator HOST:PORT"):
        distributed.initialize(num_processes=n, process_id=int(rng.integers(0, n)))


def test_unknown_preset_names_the_presets():
    with pytest.raises(ConfigError, match="unknown preset 'k4'.*'demo', 'k3', 'tiny'"):
        config.load_config("k4")
    with pytest.raises(ConfigError, match="no config.json"):
        config.load_config("/nonexistent/config.json")


def test_convert_refuses_a_tp_hint_no_mesh_can_use(hf_dir, tmp_path, rng):
    valid = sharding.valid_tp_sizes(preset("tiny"), 64)
    bad = int(rng.choice([t for t in range(2, 64) if t not in valid]))
    with pytest.raises(ConvertError, match=re.escape(f"tensor-parallel size {bad} is not valid")) as e:
        convert(hf_dir, str(tmp_path / "o"), Options(progress=False, tp=bad))
    assert f"Valid sizes: {valid}" in str(e.value)
    assert os.listdir(tmp_path) == []  # refused before anything was written


class _Killed(Exception):
    pass


def test_interrupted_conversion_is_kept_and_named(hf_dir, tmp_path, rng):
    """Killed mid-way: the staging directory says how to resume, a rerun without --resume refuses to delete the
    finished parts, --resume finishes, and the result loads."""
    out = str(tmp_path / "ck")
    stop_after = int(rng.integers(1, 4))
    seen = []

    def kill(part):
        seen.append(part)
        if len(seen) == stop_after:
            raise _Killed()

    with pytest.raises(_Killed):
        convert(hf_dir, out, Options(progress=False, workers=1), _after_part=kill)
    (stage,) = glob.glob(out + ".tmp-*")
    with pytest.raises(CheckpointError, match=f"unfinished conversion.*{os.path.basename(out)} --resume"):
        checkpoint.load(stage)
    with pytest.raises(ConvertError, match="pass --resume to continue it, or --overwrite"):
        convert(hf_dir, out, QUIET)
    assert len(os.listdir(os.path.join(stage, "parts"))) == stop_after  # nothing was thrown away
    convert(hf_dir, out, Options(progress=False, resume=True))
    assert checkpoint.load_config(out) == preset("tiny") and not glob.glob(out + ".tmp-*")


def test_conversion_names_stale_stages_of_other_options(hf_dir, tmp_path, capsys, rng):
    """An interrupted conversion with other options keeps its staging dir (its own --resume needs it); a new
    conversion into the same OUT_DIR names it instead of leaving terabytes behind unnoticed."""
    out = str(tmp_path / "ck")
    stale = f"{out}.tmp-{rng.integers(1 << 40):012x}"
    os.makedirs(os.path.join(stale, "parts"))
    convert(hf_dir, out, QUIET)
    err = capsys.readouterr().err
    assert f"interrupted conversions into {out} with other options" in err and stale in err
    assert os.path.isdir(stale) and checkpoint.load_config(out) == preset("tiny")  # kept, and the new one loads


def test_ctrl_c_stops_promptly_and_says_resume(hf_dir, tmp_path, capsys, monkeypatch):
    """Ctrl-C in the main thread used to let the thread pool run its whole queue before exiting (an hour for
    the release). Now only the job in flight finishes."""
    import convert.core as core

    started = []
    real_write, real_wait = core.Job.write, core.wait

    def write(self, params_dir, bar):
        started.append(self.spec.key)
        real_write(self, params_dir, bar)

    def wait_then_ctrl_c(futs, return_when):
        real_wait(futs, return_when="FIRST_COMPLETED")
        raise KeyboardInterrupt

    monkeypatch.setattr(core.Job, "write", write)
    monkeypatch.setattr(core, "wait", wait_then_ctrl_c)
    out = str(tmp_path / "ck")
    try:
        rc = convert_cli.main([hf_dir, out, "--no-progress", "--workers", "1"])
    except KeyboardInterrupt:  # would stop the whole pytest session
        pytest.fail(f"Ctrl-C escaped k3jax-convert as a traceback after {len(started)} jobs")
    assert rc == 130
    assert "--resume" in capsys.readouterr().err
    total = len(P.tensor_table(preset("tiny")))
    assert len(started) <= 3 < total, f"{len(started)} of {total} jobs ran after Ctrl-C"
    assert not os.path.exists(out) and glob.glob(out + ".tmp-*")


def test_corrupt_weights_give_a_checkpoint_error(ckpt, tmp_path, rng):
    d = str(tmp_path / "ck")
    shutil.copytree(ckpt, d)
    leaves = sorted(p for p in glob.glob(os.path.join(d, "params", "*")) if os.path.isdir(p))
    leaf = leaves[int(rng.integers(len(leaves)))]
    chunks = sorted(c for c in os.listdir(leaf) if not c.startswith("."))
    os.remove(os.path.join(leaf, chunks[int(rng.integers(len(chunks)))]))
    with pytest.raises(CheckpointError, match=f"missing or corrupt.*{os.path.basename(leaf)}.*k3jax-convert"):
        checkpoint.load(d)


def test_a_failure_that_is_not_the_files_is_not_called_corrupt(ckpt, monkeypatch):
    """Only a failed read of the weight files becomes "missing or corrupt, re-convert": a device running out
    of memory while restoring must not send anyone to rewrite a 1.4 TB checkpoint."""
    import orbax.checkpoint as ocp

    def oom(*a, **k):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 3.2GiB")

    monkeypatch.setattr(ocp.StandardCheckpointer, "restore", oom)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED") as e:
        checkpoint.load(ckpt)
    assert not isinstance(e.value, CheckpointError)
