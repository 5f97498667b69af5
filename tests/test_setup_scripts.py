"""The README's two commands: `.ci/run` runs the README's test command verbatim, and scripts/find-python finds a
Python >= 3.12 the way a fresh machine offers one (on PATH, behind a refusing pyenv shim, only in pyenv's
versions) or says what to install. Fake PATHs hold only the shell tools the script needs."""

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = ("sh", "grep", "sort", "ls", "cut", "cat")


def _readme_commands():
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(r"```bash\n(.*?)\n```", f.read(), re.S)


def test_ci_runs_the_readme_test_command():
    demo, test = _readme_commands()[:2]
    assert demo.startswith("sh scripts/venv && .venv/bin/python -m k3jax.generate ")
    assert test.startswith("sh scripts/venv test && ")
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = [line for line in f.read().splitlines() if line.strip() and not line.startswith("#")]
    assert ci[-1] == test and ci[-2] == "rm -rf .venv"


def _fake_bin(tmp_path, pythons: dict[str, str]):
    """A PATH directory with the shell tools plus `pythons` (name -> shell script body)."""
    b = tmp_path / "bin"
    b.mkdir(parents=True)
    for t in TOOLS:
        os.symlink(shutil.which(t), b / t)
    for name, body in pythons.items():
        (b / name).write_text(f"#!{shutil.which('sh')}\n{body}\n")
        (b / name).chmod(0o755)
    return str(b)


def _find(tmp_path, pythons, pyenv_versions=(), **env):
    root = tmp_path / "pyenv"
    for v in pyenv_versions:
        (root / "versions" / v / "bin").mkdir(parents=True)
        os.symlink(sys.executable, root / "versions" / v / "bin" / "python3")
    env = {"PATH": _fake_bin(tmp_path, pythons), "HOME": str(tmp_path), "PYENV_ROOT": str(root), **env}
    return subprocess.run(
        [shutil.which("sh"), os.path.join(ROOT, "scripts", "find-python")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


SHIM = 'echo "pyenv: python3.12: command not found" >&2; exit 127'  # pyenv's shim without PYENV_VERSION
OLD = "exit 1"  # stands for a python3 older than 3.12 (the version check exits non-zero)


@pytest.mark.skipif(sys.version_info < (3, 12), reason="the test interpreter stands for a Python >= 3.12")
def test_find_python(tmp_path):
    me = os.path.realpath(sys.executable)
    here = f'exec {sys.executable} "$@"'
    p = _find(tmp_path / "a", {"python3.12": SHIM, "python3": OLD}, pyenv_versions=("3.11.7", "3.13.0"))
    assert p.returncode == 0 and p.stdout.strip() == str(tmp_path / "a/pyenv/versions/3.13.0/bin/python3"), p
    p = _find(tmp_path / "b", {"python3.13": here, "python3": OLD})  # Debian 13: only python3.13
    assert p.returncode == 0 and os.path.realpath(p.stdout.strip()) == me, p
    p = _find(tmp_path / "c", {"python3.12": SHIM, "python3": OLD}, pyenv_versions=("3.11.7",))
    assert p.returncode == 1 and p.stdout == "" and "no Python >= 3.12 found" in p.stderr and "install" in p.stderr
    p = _find(tmp_path / "d", {"python3": OLD}, K3JAX_PYTHON=sys.executable)
    assert p.returncode == 0 and os.path.realpath(p.stdout.strip()) == me, p
    no_venv = f"""case "$*" in *ensurepip*) exit 1;; *) exec {sys.executable} "$@";; esac"""
    p = _find(tmp_path / "e", {"python3.13": no_venv})  # Debian without python3.13-venv
    assert p.returncode == 1 and "cannot make virtual environments" in p.stderr and "-venv" in p.stderr, p
