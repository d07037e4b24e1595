"""scripts/gpu_check.sh cannot rot: its dry run goes through every step that needs no GPU (the
preflight, with its CUDA checks stubbed, the kernel check reading the extension this checkout has
without a rebuild, collection of each named CUDA test file, the benchmark's arguments, the
summary); a run without CUDA stops at the
preflight as FAIL; and its rules are tested on their own, through its functions (the script,
sourced, defines them without running): the skip rule on pytest's short summary, the step's process
group killed whole at its limit, the environment every step gets, the interpreter it picks.
scripts/cuda_toolkit.py finds nvcc where the build looks.
Cost, measured on 2 idle cores: 57 s of wall time for the file. The dry run 36 s (nine short
Python processes, two of them pytest collections; no build; 40-90 s when the cores are shared),
pytest's own run of the two-GPU test 8 s, the run without CUDA 4 s, the steps run to their limits
(1-2 s each) and the rest under a second each."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import cuda_toolkit  # noqa: E402  (scripts/ is no package)

TWO_GPU_TEST = "tests/test_cuda_ranks.py::test_stage3_reduces_and_gathers_on_two_gpus_neither_hang_nor_drift"


def _env(**more) -> dict[str, str]:
    # Not the xdist worker's variables: the script's own pytest runs would take themselves for
    # workers (pytest-benchmark then disables benchmarks, which --benchmark-only refuses).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    return env | {"PYTHON": sys.executable} | more


def _rows(summary: str) -> dict[str, tuple[str, str]]:
    """The summary table's rows: step -> (status, note)."""
    rows = {}
    for line in summary.splitlines():
        if not line.strip() or line.startswith("==") or line.startswith("step "):
            continue
        name, status, _, note = (line.split(None, 3) + [""])[:4]
        rows[name] = (status, note)
    return rows


def _sourced(tmp_path, commands: str, **env) -> tuple[dict[str, tuple[str, str]], str]:
    """Run bash `commands` with the script's functions (sourced: nothing runs) and $OUT in tmp_path;
    return the rows they recorded and everything they printed."""
    program = f'source "{SCRIPT}" && mkdir -p "$LOGDIR" && {commands}; echo "== rows"; printf "%s\\n" "${{ROWS[@]}}"'
    out = subprocess.run(
        ["bash", "-c", program],
        cwd=tmp_path,
        env=_env(OUT=str(tmp_path / "out"), GPU_CHECK_KILL_GRACE_S="1", **env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    return _rows(out.stdout.split("== rows\n", 1)[1]), text


def _alive(pid: int) -> bool:
    """Whether the process runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_gpu_check_dry_run_goes_through_every_step(tmp_path):
    out = subprocess.run(
        ["bash", SCRIPT, "--dry-run"], capture_output=True, text=True, env=_env(OUT=str(tmp_path)), timeout=300
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    summary = (tmp_path / "summary.txt").read_text()
    rows = _rows(summary)
    for name in ("python", "cuda", "toolkit", "numpy", "pytest-benchmark", "build", "cuda-kernels", "collect"):
        assert name in rows, f"{name} missing from the summary:\n{summary}"
    # The preflight's CUDA checks ran, stubbed: the same snippet as a GPU run's, requiring nothing.
    assert rows["python"][0] == "PASS" and sys.executable in rows["python"][1], summary
    status, note = rows["cuda"]
    assert status == "STUB" and note.startswith(
        "stub: would require torch.cuda.is_available() and torch.cuda.device_count() >= 1; here is_available()="
    ), summary
    status, note = rows["cuda-kernels"]
    assert status == "STUB" and note.startswith("stub: would require zerofast.has_cuda_kernels(); here"), summary
    for name in ("collect", "kernel-tests", "engine-tests", "rank-tests", "demo-args", "profile-args"):
        log = tmp_path / "logs" / (name + ".log")
        assert rows[name][0] == "PASS", f"{name}:\n{summary}\n{log.read_text() if log.exists() else ''}"
    assert "memcheck" in rows and ("benchmark-args" in rows or rows["benchmark"][0] == "SKIP"), summary
    assert "offload-benchmark-args" in rows or rows["offload-benchmark"][0] == "SKIP", summary
    # Collection found the CUDA tests of each named file (not an empty selection).
    for name, files in (
        ("kernel-tests", ["tests/test_fused_adam.py", "tests/test_quant_state.py"]),
        ("engine-tests", ["tests/test_cuda_engine.py", "tests/test_cuda_offload.py"]),
        ("rank-tests", ["tests/test_cuda_ranks.py"]),
    ):
        counts = rows[name][1].split(", ")
        assert [c.split(" tests collected from ")[1] for c in counts] == files, rows[name]
        assert all(int(c.split()[0]) > 0 for c in counts), rows[name]
    assert summary.splitlines()[-1] == "== PASS", summary


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: a run would go on to the build")
def test_a_run_without_cuda_stops_at_the_preflight_as_fail(tmp_path):
    # GPU_CHECK_BUDGET_S=20: were the preflight to let the run through, no step would have the time
    # to start (NOTRUN), so this test can never rebuild the checkout's extension.
    out = subprocess.run(
        ["bash", SCRIPT],
        capture_output=True,
        text=True,
        env=_env(OUT=str(tmp_path), GPU_CHECK_BUDGET_S="20"),
        timeout=120,
    )
    summary = (tmp_path / "summary.txt").read_text()
    assert out.returncode == 1, f"rc {out.returncode}:\n{out.stdout}{out.stderr}"
    rows = _rows(summary)
    assert list(rows) == ["python", "cuda"], summary
    status, note = rows["cuda"]
    assert status == "FAIL" and "got is_available()=False, device_count()=0" in note, summary
    assert summary.splitlines()[-1] == "== FAIL", summary


def test_a_run_whose_python_cannot_start_stops_at_the_preflight_as_fail(tmp_path):
    out = subprocess.run(
        ["bash", SCRIPT],
        capture_output=True,
        text=True,
        env=_env(OUT=str(tmp_path), PYTHON=str(tmp_path / "no-python"), GPU_CHECK_BUDGET_S="20"),
        timeout=60,
    )
    summary = (tmp_path / "summary.txt").read_text()
    assert out.returncode == 1 and list(_rows(summary)) == ["preflight-cuda"], summary
    status, note = _rows(summary)["preflight-cuda"]
    assert status == "FAIL" and "no-python" in note and summary.splitlines()[-1] == "== FAIL", summary


def test_gpu_check_rejects_an_unknown_argument():
    out = subprocess.run(["bash", SCRIPT, "--fast"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "usage: bash scripts/gpu_check.sh [--dry-run]; got '--fast'" in out.stderr


# --- the skip rule ----------------------------------------------------------------------------------------

ALLOWED = "SKIPPED [1] tests/test_cuda_ranks.py:378: needs 2 GPUs (NCCL: one rank per GPU)"
UNEXPECTED = "SKIPPED [3] tests/test_cuda_engine.py:13: needs a CUDA GPU and zerofast's CUDA kernels"


def _pytest_log(*skips: str) -> str:
    return "\n".join(["..s." * 10, "=== short test summary info ===", *skips, "40 passed, 4 skipped in 12.00s", ""])


@pytest.mark.parametrize(
    "skips, verdict",
    [
        ([ALLOWED], "PASS"),
        ([], "PASS"),
        (
            [ALLOWED, UNEXPECTED],
            "FAIL 3 unexpected skip(s): [3] tests/test_cuda_engine.py:13: needs a CUDA GPU and zerofast's CUDA kernels",
        ),
        ([ALLOWED.replace("[1]", "[2]")], "FAIL 2 unexpected skip(s): [2] tests/test_cuda_ranks.py:378: needs 2 GPUs"),
        (
            [UNEXPECTED, "SKIPPED [1] tests/test_fused_adam.py:40: no bf16"],
            "FAIL 4 unexpected skip(s): [3] tests/test_cuda_engine.py:13: needs a CUDA GPU and zerofast's CUDA kernels; "
            "[1] tests/test_fused_adam.py:40: no bf16",
        ),
    ],
    ids=["two-gpu-only", "none", "one-unexpected", "allowed-twice", "two-unexpected"],
)
def test_a_cuda_step_fails_on_any_skip_but_the_two_gpu_case(tmp_path, skips, verdict):
    (tmp_path / "pytest.log").write_text(_pytest_log(*skips))
    # Through the step itself: a command that exits 0 with this summary.
    rows, text = _sourced(tmp_path, "skip_verdict pytest.log; step --skips tests 30 cat pytest.log")
    assert text.splitlines()[0].startswith(verdict), text
    status, note = rows["tests"]
    want = "PASS" if verdict == "PASS" else "FAIL"
    assert status == want, f"{status} {note}"
    if want == "FAIL":
        assert note.startswith(verdict.removeprefix("FAIL ")) and note.endswith("see logs/tests.log"), note


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="the two-GPU test runs here instead of skipping")
def test_the_two_gpu_skip_pytest_prints_is_the_one_allowed(tmp_path):
    """The allowed pattern against pytest's own summary line for the two-GPU test (run from the
    checkout with its path, as the GPU run does), so that its reason, file or pytest's format cannot
    drift from the script's pattern."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", TWO_GPU_TEST],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert out.returncode == 0 and "SKIPPED [1] tests/test_cuda_ranks.py:" in out.stdout, out.stdout + out.stderr
    (tmp_path / "pytest.log").write_text(out.stdout)
    _, text = _sourced(tmp_path, "skip_verdict pytest.log")
    assert text.splitlines()[0] == "PASS", f"{text}\npytest printed:\n{out.stdout}"


# --- each step a process group, killed whole ---------------------------------------------------------------

# A launcher that ignores TERM (so only KILL stops it), with a child in its process group and one in a
# session of its own (as torchrun starts its workers), both ignoring TERM too (ignored signals are
# inherited).
LAUNCHER = "trap '' TERM; sleep 300 & echo $! > in_group.pid; setsid sleep 300 & echo $! > own_session.pid; wait"


def test_a_plain_timeout_leaves_a_child_in_its_own_session_running(tmp_path):
    """The control for the next test: what timeout(1) alone leaves behind."""
    subprocess.run(["timeout", "-k", "1", "1", "bash", "-c", LAUNCHER], cwd=tmp_path, timeout=60)
    own = int((tmp_path / "own_session.pid").read_text())
    survived = _alive(own)
    if survived:
        os.kill(own, signal.SIGKILL)
    assert survived, "timeout(1) killed the child in its own session: the next test proves nothing"


def test_a_step_past_its_limit_is_killed_whole(tmp_path):
    t0 = time.monotonic()
    rows, text = _sourced(tmp_path, f"step launcher 2 bash -c {shlex.quote(LAUNCHER)}")
    took = time.monotonic() - t0
    status, note = rows["launcher"]
    assert status == "TIMEOUT" and note.startswith("over 2s, every process of the step killed"), text
    pids = {name: int((tmp_path / f"{name}.pid").read_text()) for name in ("in_group", "own_session")}
    alive = {name: pid for name, pid in pids.items() if _alive(pid)}
    for pid in alive.values():
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"left running: {alive}"
    log = (tmp_path / "out" / "logs" / "launcher.log").read_text()
    assert "over 2 s: stopping the step's processes" in log, log
    assert took < 30, f"the step took {took:.0f} s for a 2 s limit and 1 s of grace"


def test_processes_a_step_leaves_behind_are_killed(tmp_path):
    rows, text = _sourced(tmp_path, "step leaves 30 bash -c 'setsid sleep 300 & echo $! > left.pid'")
    left = int((tmp_path / "left.pid").read_text())
    if _alive(left):
        os.kill(left, signal.SIGKILL)
        pytest.fail(f"the step's leftover {left} still runs: {text}")
    assert rows["leaves"][0] == "PASS", text
    log = (tmp_path / "out" / "logs" / "leaves.log").read_text()
    assert f"the step left processes running; stopping {left}" in log, log


def test_every_step_runs_in_a_session_of_its_own_gloo_on_loopback_the_ranks_deadline_before_its_limit(tmp_path):
    rows, text = _sourced(
        tmp_path,
        "export_env; step env 100 bash -c 'echo $$ $(ps -o pgid=,sid= -p $$) $GLOO_SOCKET_IFNAME "
        "$ZEROFAST_RANKS_DEADLINE $(date +%s)'",
        GLOO_SOCKET_IFNAME="",
    )
    assert rows["env"][0] == "PASS", text
    pid, pgid, sid, ifname, deadline, now = (tmp_path / "out" / "logs" / "env.log").read_text().split()
    assert pid == pgid == sid, f"the step's command {pid}: process group {pgid}, session {sid}"
    assert ifname == "lo", text
    # The harness's timeout ends 30 s before the step's 100 s (tests/test_cuda_ranks.py _ranks_timeout).
    assert 68 <= int(deadline) - int(now) <= 70, f"deadline {deadline}, now {now}"


def test_the_script_runs_with_python3_where_the_checkout_has_no_venv(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts")
    copy = tmp_path / "scripts" / "gpu_check.sh"

    def python_used(**env) -> str:
        environ = {k: v for k, v in os.environ.items() if k != "PYTHON"} | env
        out = subprocess.run(
            ["bash", "-c", f'source "{copy}" && echo "$PY"'], env=environ, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert python_used() == "python3"
    venv_python = tmp_path / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text("#!/bin/sh\n")
    venv_python.chmod(0o755)
    assert python_used() == str(venv_python)
    assert python_used(PYTHON="/opt/py/bin/python") == "/opt/py/bin/python"


# --- scripts/cuda_toolkit.py ------------------------------------------------------------------------------


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
