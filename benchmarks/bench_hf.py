"""The Hugging Face Trainer with ZeroAdam (ZeroTrainer stages 1-3) next to transformers.Trainer +
DDP and Trainer + FSDP2 (Accelerate's FSDP plugin), and ZeroAdam in a hand-written loop on the
same model and batches (loop1-3: what the Trainer adds), full fine-tuning and LoRA, on a
GPT-2-small-shaped model (124M parameters, from its config), 2 gloo ranks x 1 thread, one torchrun
launch per case (benchmarks/hf_bench_job.py). Each case: the median step time after two warm-up
steps, and per rank the parameter storage alive after a step and the peak RSS; one run, the
benchmark's own time is the whole launch (imports, model, 8 steps). A case whose system cannot run
here (an error from the framework itself) is reported with its reason instead of a time.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("peft")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "benchmarks", "hf_bench_job.py")
SYSTEMS = ["ddp", "fsdp2", "zero1", "zero2", "zero3", "loop1", "loop2", "loop3"]
_RESULTS = {}


def _launch(system, tuning, out):
    env = dict(
        os.environ,
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            JOB,
            system,
            tuning,
            out,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )


@pytest.mark.parametrize("tuning", ["full", "lora"])
@pytest.mark.parametrize("system", SYSTEMS)
def test_hf_trainer(benchmark, tmp_path, system, tuning):
    out = str(tmp_path / f"{system}-{tuning}")
    done = benchmark.pedantic(_launch, args=(system, tuning, out), rounds=1, iterations=1)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
        _RESULTS[system, tuning] = {"error": reason}
        benchmark.extra_info["error"] = reason
        if system == "fsdp2":  # the framework's own limit here: reported, not a zerofast failure
            pytest.skip(f"Trainer + FSDP2 does not run here: {reason}")
        raise AssertionError(done.stdout[-2000:] + done.stderr[-4000:])
    with open(out + ".json") as f:
        result = json.load(f)
    if system == "fsdp2" and not result["fsdp_dtensors"]:
        # Measured with Accelerate 1.15: with use_cpu=True the Trainer's FSDP plugin is not applied
        # and the model is wrapped in DDP; a row under FSDP2's name would be DDP's.
        reason = f"Accelerate ignores the FSDP plugin on CPU (the model was wrapped in {result['wrapped']})"
        _RESULTS[system, tuning] = {"error": reason}
        pytest.skip(f"Trainer + FSDP2 does not run here: {reason}")
    _RESULTS[system, tuning] = result
    benchmark.extra_info.update(
        step_s=result["step_s"],
        rank0_param_mib=result["ranks"][0]["param_bytes"] / 2**20,
        rank0_peak_mib=result["ranks"][0]["peak_rss"] / 2**20,
    )


def teardown_module():
    """The table docs/benchmarks.md carries: step time and its ratio to Trainer + DDP, memory per rank."""
    if not _RESULTS:
        return
    lines = [
        "",
        "Hugging Face Trainer, GPT-2-small shape (124M), 2 gloo ranks x 1 thread, fp32, seq 128:",
        f"{'system':<10}{'tuning':<6}{'step s':>8}{'x DDP':>7}{'params MiB/rank':>17}{'peak RSS MiB':>14}",
    ]
    for tuning in ("full", "lora"):
        base = _RESULTS.get(("ddp", tuning), {}).get("step_s")
        for system in SYSTEMS:
            r = _RESULTS.get((system, tuning))
            if r is None:
                continue
            if "error" in r:
                lines.append(f"{system:<10}{tuning:<6}  does not run here: {r['error']}")
                continue
            ratio = f"{r['step_s'] / base:7.2f}" if base else "      -"
            params = max(x["param_bytes"] for x in r["ranks"]) / 2**20
            peak = max(x["peak_rss"] for x in r["ranks"]) / 2**20
            lines.append(f"{system:<10}{tuning:<6}{r['step_s']:8.3f}{ratio}{params:17.1f}{peak:14.0f}")
    print("\n".join(lines))
