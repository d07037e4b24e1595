"""Hugging Face Accelerate, one custom loop (benchmarks/accelerate_bench_job.py) with Accelerator + DDP + torch
AdamW and with ZeroAccelerator + ZeroAdam at stages 1-3: a GPT-2-small-shaped model (124M parameters, from its
config), fp32, sequences of 128 tokens, 1 per rank, accumulation 2, 2 gloo ranks x 1 thread, one `accelerate
launch` per case, the cases in two interleaved rounds (these machines are shared and noisy). Each case: the
median optimizer-step time after two warm-up steps, and per rank the parameter storage alive after a step and
the peak RSS.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("accelerate")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "benchmarks", "accelerate_bench_job.py")
SYSTEMS = ["ddp", "zero1", "zero2", "zero3"]
_RESULTS: dict[str, list] = {}


def _launch(system, out):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", JOB, system, out]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)


@pytest.mark.parametrize("system", [s for _ in range(2) for s in SYSTEMS], ids=lambda s: s)
def test_accelerate_loop(benchmark, tmp_path, system):
    out = str(tmp_path / system)
    done = benchmark.pedantic(_launch, args=(system, out), rounds=1, iterations=1)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    with open(out + ".json") as f:
        result = json.load(f)
    assert result["wrapped"] == ("DistributedDataParallel" if system == "ddp" else "GPT2LMHeadModel"), result
    _RESULTS.setdefault(system, []).append(result)
    benchmark.extra_info.update(step_s=result["step_s"], rank0_peak_mib=result["ranks"][0]["peak_rss"] / 2**20)


def teardown_module():
    """The table docs/benchmarks.md carries: each round's step time and its ratio to Accelerate + DDP's in
    the same round, memory per rank."""
    if not _RESULTS:
        return
    lines = ["", "Accelerate custom loop, GPT-2-small shape (124M), 2 gloo ranks x 1 thread, fp32, seq 128, accum 2:"]
    lines.append(f"{'system':<8}{'step s per round':>20}{'x DDP per round':>18}{'params MiB/rank':>17}{'peak MiB':>10}")
    base = [r["step_s"] for r in _RESULTS.get("ddp", [])]
    for system in SYSTEMS:
        rows = _RESULTS.get(system, [])
        if not rows:
            continue
        steps = " / ".join(f"{r['step_s']:.3f}" for r in rows)
        ratios = " / ".join(f"{r['step_s'] / b:.2f}" for r, b in zip(rows, base))
        params = max(x["param_bytes"] for x in rows[-1]["ranks"]) / 2**20
        peak = max(x["peak_rss"] for r in rows for x in r["ranks"]) / 2**20
        lines.append(f"{system:<8}{steps:>20}{ratios:>18}{params:17.1f}{peak:10.0f}")
    print("\n".join(lines))
