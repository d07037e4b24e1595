"""The compiled core's layering: every source in csrc/ but the bindings (bindings.cpp) builds from torch's
headers alone, so pybind11 and Python stay in the binding file. Each source is run through the
preprocessor (no compilation) with torch's include directories and without Python's: an include of
pybind11, torch/extension.h or Python.h, direct or through another header, fails it. 5-8 s of CPU
on one core; skipped where no C++ compiler is on PATH."""

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils import cpp_extension

CSRC = Path(__file__).resolve().parent.parent / "csrc"
BINDINGS = "bindings.cpp"


def _compiler():
    return os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"


def test_core_sources_build_without_python_headers():
    cxx = _compiler().split()
    if shutil.which(cxx[0]) is None:
        pytest.skip(f"no C++ compiler {cxx[0]!r} on PATH")
    core = sorted(p for p in CSRC.glob("*.cpp") if p.name != BINDINGS)
    assert {p.name for p in core} >= {"buckets.cpp", "bucket_pool.cpp", "replica_reducer.cpp", "grad_path.cpp"}
    includes = [f"-I{d}" for d in cpp_extension.include_paths()] + [f"-I{CSRC}"]
    for source in core:
        # -M: the headers each source reaches, transitively; a missing one (Python.h) is an error.
        run = subprocess.run([*cxx, "-std=c++20", "-M", *includes, str(source)], capture_output=True, text=True)
        assert run.returncode == 0, f"{source.name} needs more than torch's headers:\n{run.stderr[-2000:]}"
        reached = [h for h in run.stdout.split() if "pybind11" in h or h.endswith("Python.h")]
        assert not reached, f"{source.name} reaches Python's or pybind11's headers: {reached[:3]}"
