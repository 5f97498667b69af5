"""Every test that runs a kernel in Mosaic GPU interpret mode is marked CPU-only (the GPU tests run the real
kernels). Interpret mode runs each simulated thread of a cluster or CTA as a JAX computation of its own,
compiled and run on the default device from inside a host callback of the kernel's (jax 0.11.2,
pallas/mosaic/interpret/thread_map.py); on a GPU machine that device is the GPU. The four unmarked ones
(clusters of 2 or 4 CTAs) failed on the H200 (issue 24)."""

import ast
import pathlib

import pytest

TESTS = sorted(p for p in pathlib.Path(__file__).parent.glob("test_*.py") if p.name != pathlib.Path(__file__).name)
CPU_ONLY_MARKS = ("cpu_only", "N_GPUS > 0", "ON_GPU")  # kernel_testbase.cpu_only, or a skipif on a GPU count


@pytest.mark.parametrize("path", TESTS, ids=lambda p: p.name)
def test_interpret_mode_tests_are_cpu_only(path):
    text = path.read_text()
    unmarked = []
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            runs_interpret = "InterpretGPUParams(" in (ast.get_source_segment(text, node) or "")
            decorators = " ".join(ast.get_source_segment(text, d) or "" for d in node.decorator_list)
            if runs_interpret and not any(mark in decorators for mark in CPU_ONLY_MARKS):
                unmarked.append(node.name)
    assert not unmarked, f"{path.name}: mark these @cpu_only (kernel_testbase): {unmarked}"
