"""scripts/gpu_check.sh cannot rot: its dry run goes through every step that needs no GPU (the
preflight, the build's check without a rebuild, collection of each named CUDA test file, the
benchmark's arguments, the summary), and scripts/cuda_toolkit.py finds nvcc where the build looks.
Cost: about 10 s of CPU time (seven short Python processes, two of them pytest collections; no
build), 40-90 s of wall time when the machine's 2 cores are shared."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import cuda_toolkit  # noqa: E402  (scripts/ is no package)


def test_gpu_check_dry_run_goes_through_every_step(tmp_path):
    # Not the xdist worker's variables: the script's own pytest runs would take themselves for
    # workers (pytest-benchmark then disables benchmarks, which --benchmark-only refuses).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(OUT=str(tmp_path), PYTHON=sys.executable)
    out = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    summary = (tmp_path / "summary.txt").read_text()
    rows = {line.split()[0]: line.split()[1] for line in summary.splitlines()[2:-1]}
    for name in (
        "toolkit",
        "numpy",
        "pytest-benchmark",
        "build-check",
        "kernel-tests",
        "engine-tests",
        "rank-tests",
        "demo-args",
        "profile-args",
    ):
        assert name in rows, f"{name} missing from the summary:\n{summary}"
    for name in ("build-check", "kernel-tests", "engine-tests", "rank-tests", "demo-args", "profile-args"):
        assert rows[name] == "PASS", f"{name}:\n{summary}\n{(tmp_path / 'logs' / (name + '.log')).read_text()}"
    assert "memcheck" in rows and ("benchmark-args" in rows or rows.get("benchmark") == "SKIP"), summary
    # Collection found the tests of each named file (not an empty selection).
    for name in ("kernel-tests", "engine-tests", "rank-tests"):
        line = next(line for line in summary.splitlines() if line.startswith(name))
        assert int(line.split()[3]) > 0 and "tests collected from tests/test_" in line, line
    assert summary.splitlines()[-1] == "== PASS", summary


def test_gpu_check_rejects_an_unknown_argument():
    out = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--fast"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "usage: bash scripts/gpu_check.sh [--dry-run]; got '--fast'" in out.stderr


def _fake_nvcc(folder, release: str) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "nvcc")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.48'\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return path


def test_nvcc_is_found_through_cuda_home_then_path(tmp_path, monkeypatch):
    home_nvcc = _fake_nvcc(tmp_path / "home" / "bin", "13.0")
    path_nvcc = _fake_nvcc(tmp_path / "path", "12.8")
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "home"))
    assert cuda_toolkit.find_nvcc() == (home_nvcc, "$CUDA_HOME")
    monkeypatch.delenv("CUDA_HOME")
    assert cuda_toolkit.find_nvcc() == (path_nvcc, "PATH")
    assert cuda_toolkit.nvcc_release(path_nvcc) == "12.8"


def test_nvcc_falls_back_to_usr_local_cuda(tmp_path, monkeypatch):
    fallback = _fake_nvcc(tmp_path / "cuda" / "bin", "13.0")
    monkeypatch.setattr(cuda_toolkit, "FALLBACK_NVCC", fallback)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    assert cuda_toolkit.find_nvcc() == (fallback, "/usr/local/cuda")
    monkeypatch.setattr(cuda_toolkit, "FALLBACK_NVCC", str(tmp_path / "none" / "nvcc"))
    nvcc, looked = cuda_toolkit.find_nvcc()
    assert nvcc is None and "PATH" in looked and "/usr/local/cuda/bin" in looked


@pytest.mark.parametrize(
    "nvcc_version, torch_version, problem",
    [
        ("13.0", "13.0", None),
        ("13.1", "13.0", None),  # minor versions may differ: torch warns, the build works
        ("12.8", "13.0", "nvcc /x/nvcc is CUDA 12.8 but torch was built with CUDA 13.0"),
        ("13.0", None, "torch is a CPU-only build"),
        (None, "13.0", "did not say its CUDA release"),
    ],
)
def test_the_cuda_major_versions_must_match(nvcc_version, torch_version, problem):
    found = cuda_toolkit.Toolkit("/x/nvcc", "PATH", nvcc_version, torch_version).problem()
    if problem is None:
        assert found is None
    else:
        assert problem in found
