"""Checkpoint integrity: the converter's manifest, `k3jax-convert --check` / `--write-manifest`, the size checks of
every load and `verify=True`; a flipped byte, a missing file, a truncated file, a missing manifest; a conversion
resumed across a kill; the demo's cache made before manifests is rebuilt."""

import glob
import hashlib
import os
import shutil

import pytest
from fixtures_demo import tiny_ckpt  # noqa: F401  (session fixture)

from convert import __main__ as convert_cli
from convert.core import Options, convert
from k3jax import checkpoint, generate
from k3jax import manifest as M
from k3jax.checkpoint import CheckpointError
from k3jax.config import preset


@pytest.fixture
def ck(tiny_ckpt, tmp_path):  # noqa: F811  (a copy of the session's tiny checkpoint, ours to damage)
    d = str(tmp_path / "ck")
    shutil.copytree(tiny_ckpt.ckpt, d)
    return d


def _chunk_files(d):
    """Every weight chunk file (not .zarray), sorted."""
    return sorted(p for p in glob.glob(os.path.join(d, "params", "*", "*")) if not p.endswith(M.ZARRAY))


def _pick(d, rng):
    files = _chunk_files(d)
    path = files[int(rng.integers(len(files)))]
    return path, os.path.relpath(path, d), os.path.basename(os.path.dirname(path))


def _check_cli(capsys, d):
    capsys.readouterr()
    rc = convert_cli.main(["--check", d, "--no-progress", "--workers", "2"])
    return rc, capsys.readouterr()


def test_manifest_lists_every_file_with_its_sha256(tiny_ckpt, rng):  # noqa: F811
    """The digests the converter took while writing equal a fresh pass over the files (M.build), and a file's
    digest is the first 16 hex digits of its SHA-256 computed here independently; nothing is unlisted."""
    d = tiny_ckpt.ckpt
    m = M.read(d)
    assert m["hash"] == "sha256-64" and M.verify(d, m, workers=2, progress=False) == []
    assert M.build(d, workers=2, progress=False) == m
    listed = set(m["files"])
    for rel, c in m["chunks"].items():
        grid = c["grid"]
        n = 1
        for g in grid:
            n *= g
        assert len(c["digests"]) == n * M.DIGEST_HEX
        for i in range(n):
            listed.add(f"{rel}/{M.chunk_key(M._index_at(i, tuple(grid)))}")
    on_disk = {os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs}
    assert on_disk == listed | {M.MANIFEST}
    path, rel, _ = _pick(d, rng)
    with open(path, "rb") as f:
        want = hashlib.sha256(f.read()).hexdigest()[: M.DIGEST_HEX]
    c = m["chunks"][os.path.dirname(rel)]
    key = os.path.basename(rel)
    i = M._flat(tuple(int(k) for k in key.split(".")), tuple(c["grid"])) if c["grid"] else 0
    assert c["digests"][i * M.DIGEST_HEX : (i + 1) * M.DIGEST_HEX] == want


def test_flipped_byte(ck, rng, capsys):
    """Sizes still match, so a plain load cannot see it; --check and --verify-checkpoint name file and tensor."""
    path, rel, tensor = _pick(ck, rng)
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        i = int(rng.integers(len(data)))
        data[i] ^= int(rng.integers(1, 256))
        f.seek(0)
        f.write(data)
    rc, out = _check_cli(capsys, ck)
    assert rc == 1, out
    last = out.err.strip().splitlines()[-1]
    assert last.startswith("k3jax-convert: error:") and rel in last and f"tensor {tensor}" in last, out.err
    assert "checksum differs" in last
    with pytest.raises(CheckpointError, match=f"missing or corrupt.*{rel}.*tensor {tensor}.*k3jax-convert"):
        checkpoint.load(ck, verify=True)
    capsys.readouterr()
    rc = generate.main(["--checkpoint", ck, "--prompt-ids", "1,2", "--max-new-tokens", "1", "--verify-checkpoint"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and rel in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_missing_or_truncated_file_refused_by_every_load(ck, rng, capsys, damage):
    path, rel, tensor = _pick(ck, rng)
    if damage == "missing":
        os.remove(path)
        what = "missing"
    else:
        size = os.path.getsize(path)
        keep = int(rng.integers(0, size))
        os.truncate(path, keep)
        what = f"{keep} bytes, the manifest says {size}"
    with pytest.raises(CheckpointError, match=f"missing or corrupt: 1 of .*{rel} \\(tensor {tensor}\\): {what}"):
        checkpoint.load(ck)  # no verify: presence and sizes are checked on every load
    rc, out = _check_cli(capsys, ck)
    assert rc == 1 and rel in out.err and what in out.err, out.err


def test_missing_manifest_refused_then_written(ck, rng, capsys):
    os.remove(os.path.join(ck, M.MANIFEST))
    with pytest.raises(CheckpointError, match=f"no {M.MANIFEST}.*k3jax-convert --write-manifest {ck}"):
        checkpoint.load(ck)
    rc, out = _check_cli(capsys, ck)
    assert rc == 2 and "--write-manifest" in out.err and len(out.err.splitlines()) == 1, out.err
    # an incomplete checkpoint gets no manifest: writing one would bless the damage
    path, rel, _ = _pick(ck, rng)
    moved = path + ".away"
    os.rename(path, moved)
    assert convert_cli.main(["--write-manifest", ck, "--no-progress"]) == 2
    assert rel in capsys.readouterr().err and not os.path.exists(os.path.join(ck, M.MANIFEST))
    os.rename(moved, path)
    assert convert_cli.main(["--write-manifest", ck, "--no-progress"]) == 0
    assert "it vouches for the files as they are now" in capsys.readouterr().out
    rc, out = _check_cli(capsys, ck)
    assert rc == 0 and "all" in out.out and "match the manifest" in out.out, out
    cfg, _ = checkpoint.load(ck)
    assert cfg == preset("tiny")
    assert convert_cli.main(["--write-manifest", ck, "--no-progress"]) == 2  # never silently replaced
    assert "already has a manifest" in capsys.readouterr().err


class _Killed(Exception):
    pass


def test_resumed_conversion_has_a_complete_manifest(tiny_ckpt, tmp_path, rng):  # noqa: F811
    """Killed after some parts, resumed: the finished parts' digests come from their markers, and the result
    verifies. A marker from a converter before manifests (empty file) makes its part be redone."""
    out = str(tmp_path / "ck")
    stop_after, seen = int(rng.integers(2, 5)), []

    def kill(part):
        seen.append(part)
        if len(seen) == stop_after:
            raise _Killed()

    with pytest.raises(_Killed):
        convert(tiny_ckpt.hf, out, Options(progress=False, workers=1), _after_part=kill)
    (stage,) = glob.glob(out + ".tmp-*")
    old = seen[int(rng.integers(len(seen)))]
    open(os.path.join(stage, "parts", old + ".done"), "w").close()  # the old converter's empty marker
    redone = []
    convert(tiny_ckpt.hf, out, Options(progress=False, resume=True), _after_part=redone.append)
    assert old in redone and not set(redone) & (set(seen) - {old})
    m = M.read(out)
    assert M.verify(out, m, workers=2, progress=False) == [] and M.build(out, workers=2, progress=False) == m


def test_demo_cache_made_before_manifests_is_rebuilt(tmp_path, monkeypatch):
    """A user's ~/.cache/k3jax demo model from before this change has no manifest; the README's demo command
    must still work: the demo is rebuilt (it is ours), not refused."""
    import k3jax.config

    monkeypatch.setenv("K3JAX_CACHE", str(tmp_path / "cache"))
    real = k3jax.config.preset
    monkeypatch.setattr(k3jax.config, "preset", lambda n: real("tiny" if n == "demo" else n))  # fast
    said = []
    d = generate.demo_checkpoint(said.append)
    assert "making the embedded demo model" in said[-1]
    assert generate.demo_checkpoint(said.append) == d and len(said) == 1  # reused as it is
    os.remove(os.path.join(d, M.MANIFEST))
    assert generate.demo_checkpoint(said.append) == d
    assert "rebuilding" in said[-1] and "before checkpoints had manifests" in said[-1]
    assert M.verify(d, M.read(d), workers=2, progress=False) == []
    assert not [p for p in os.listdir(tmp_path / "cache") if ".tmp-" in p]
