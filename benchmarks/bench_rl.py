"""A GRPO step (generate, score, reference log-probs, update) with TRL's GRPOTrainer: ZeroGRPOTrainer
at stage 3 generating with the whole model gathered (ds3_gather_for_generation=True, opt.
gathered_params()) and unit by unit (False), at stage 2, and GRPOTrainer + DDP; GRPOTrainer +
DeepSpeed ZeRO-3 where deepspeed imports (else its reason). A GPT-2-shaped model small enough for 2
CPU cores (4 layers, width 256, vocabulary 8192: 5.3M parameters, fp32), beta 0.04, 4 prompts x 4
sampled completions of 16 tokens per rank, 2 gloo ranks x 1 thread, one torchrun launch
(benchmarks/rl_bench_job.py: 3 rounds, each training every system in turn for 4 steps, so a shared
machine's load falls on all alike; the medians of the steps after the first of each training).
Per system: the step's time split into generation (the whole phase, and the part inside the
policy's generate(): the rest is entering and leaving opt.gathered_params() in zero3_gathered, a
collective that also waits for the slower rank) and the rest (scoring, reference log-probs,
update), generated tokens/s (both ranks' completion tokens over the slower rank's time inside
generate(); the median and the best step),
the unit gathers and policy forwards inside one step's generation (rank 0), and per rank the most
parameter storage alive at once (policy and reference) and the reference model's storage between
its forwards. Goals: the gathered mode's tokens/s >= 0.9x DDP's; unit by unit, every unit once per
forward; the reference model 1/N per rank at stage 3 (checked below; the times are reported).
After the trainings, the policy's generate() alone, the three modes called in turn 9 times (each
first in turn): the
model whole (DDP's and stage 2's generation), stage 3 inside opt.gathered_params() and unit by
unit, for a ratio that a shared machine's load disturbs less than the trainings' rounds.
"""

import json
import os
import subprocess
import sys

import pytest
from harness import launch_env

pytest.importorskip("trl")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "benchmarks", "rl_bench_job.py")


def _launch(out):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", JOB, out]
    return subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=1800)


def test_grpo_step(benchmark, tmp_path):
    out = str(tmp_path / "rl")
    done = benchmark.pedantic(_launch, args=(out,), rounds=1, iterations=1)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    with open(out + ".json") as f:
        results = json.load(f)
    systems, ddp = results["systems"], results["systems"]["ddp"]
    lines = [
        "",
        f"GRPO step, GPT-2-shaped {results['params'] / 1e6:.1f}M, 2 gloo ranks x 1 thread, fp32, beta 0.04:",
        f"{'system':<16}{'step s':>8}{'gen s':>7}{'decode s':>9}{'rest s':>8}{'tok/s':>7}{'x DDP':>7}{'best':>6}{'x DDP':>7}"
        f"{'gathers/fwd (gen)':>19}{'peak params MiB/rank':>22}{'ref MiB/rank':>14}",
    ]
    for name, r in systems.items():
        if r.get("error"):
            lines.append(f"{name:<16}does not run here: {r['error']}")
            continue
        gathers = f"{r['gathers']:.0f}/{r['forwards']:.0f}"
        lines.append(
            f"{name:<16}{r['step_s']:8.3f}{r['gen_s']:7.3f}{r['decode_s']:9.3f}{r['train_s']:8.3f}{r['tokens_per_s']:7.0f}"
            f"{r['tokens_per_s'] / ddp['tokens_per_s']:7.2f}{r['best_tokens_per_s']:6.0f}"
            f"{r['best_tokens_per_s'] / ddp['best_tokens_per_s']:7.2f}{gathers:>19}{r['peak_param_mib'][0]:22.1f}"
            f"{r['ref_mib'][0]:14.1f}"
        )
        benchmark.extra_info[name] = {
            k: r[k] for k in ("step_s", "gen_s", "train_s", "tokens_per_s", "best_tokens_per_s")
        }
    tokens = 2 * 16 * 16  # both ranks' prompts x new tokens per interleaved call
    inter = results["interleaved"]
    lines.append("generate() alone, call by call in turn (16 prompts x 16 tokens per rank), median | best:")
    for mode in ("whole", "gathered", "streamed"):
        med, best = inter[mode]["median"], inter[mode]["best"]
        lines.append(
            f"  {mode:<10}{med:7.3f} s{tokens / med:7.0f} tok/s{inter['whole']['median'] / med:6.2f}x whole |"
            f"{best:7.3f} s{tokens / best:7.0f} tok/s{inter['whole']['best'] / best:6.2f}x whole"
        )
        benchmark.extra_info[f"interleaved_{mode}"] = inter[mode]
    print("\n".join(lines))
    gathered, streamed = systems["zero3_gathered"], systems["zero3_streamed"]
    assert gathered["gathers"] == gathered["units"]  # every unit once, on entering the block; none per token
    assert streamed["gathers"] == streamed["units"] * streamed["forwards"]  # every unit once per forward
    for sharded in (gathered, streamed):  # half the reference per rank, give or take alignment padding
        assert all(abs(mib - ddp["ref_mib"][0] / 2) <= 0.01 * ddp["ref_mib"][0] for mib in sharded["ref_mib"])
