"""The supported torch range (zerofast/compat.py) and its checks: setup.py refuses another torch
before compiling anything, `import zerofast` refuses one at import, each naming the range and the
torch found; the package metadata says the same range. Cost: three short interpreters (about 10 s)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from harness import ROOT

from zerofast import compat


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.14.1"])
def test_the_supported_releases_pass(version):
    assert compat.unsupported(version) is None
    compat.check_torch(version)


@pytest.mark.parametrize("version", ["2.10.0", "2.9.1+cu128", "2.15.0", "3.0.0"])
def test_a_torch_outside_the_range_is_refused_naming_it(version, monkeypatch):
    monkeypatch.delenv(compat.OVERRIDE, raising=False)
    with pytest.raises(ImportError) as e:
        compat.check_torch(version)
    assert f"this is torch {version}" in str(e.value) and "torch>=2.11,<2.15" in str(e.value)
    monkeypatch.setenv(compat.OVERRIDE, "1")
    with pytest.warns(UserWarning, match=f"this is torch {re.escape(version)}; going on because"):
        compat.check_torch(version)


def test_an_unreadable_version_is_named():
    with pytest.raises(ValueError, match="cannot read a torch release from version 'nightly'"):
        compat.release("nightly")


def test_the_package_metadata_states_the_same_range():
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    assert f'dependencies = ["{compat.SUPPORTED}"]' in text
    assert f'"{compat.SUPPORTED}"]' in text.split("[build-system]")[1].split("[project]")[0]
    assert compat.OLDEST <= compat.release(torch.__version__) <= compat.NEWEST  # this run's torch


# Runs with torch's version replaced, as a torch outside the range would report it.
_AS_TORCH = "import sys, torch; torch.__version__ = sys.argv[1]; "


def _run(code: str, version: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != compat.OVERRIDE}
    return subprocess.run(
        [sys.executable, "-c", _AS_TORCH + code, version],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


def test_import_refuses_an_unsupported_torch():
    out = _run("import zerofast", "2.10.0")
    assert out.returncode == 1 and "ImportError: zerofast supports torch 2.11 to 2.14" in out.stderr, out.stderr
    assert "this is torch 2.10.0" in out.stderr


def test_setup_refuses_an_unsupported_torch_before_compiling(tmp_path):
    code = f"import runpy; sys.argv = ['setup.py', 'build_ext', '--build-temp', {str(tmp_path)!r}]; runpy.run_path('setup.py')"
    out = _run(code, "2.15.0")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "zerofast supports torch 2.11 to 2.14 (torch>=2.11,<2.15); this is torch 2.15.0" in out.stderr
    assert os.listdir(tmp_path) == []  # nothing compiled
