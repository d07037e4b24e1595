"""zerofast.integrations.accelerate: ZeroAccelerator in real launches against Accelerate's own path. One
custom loop (tests/jobs/accelerate_job.py: accumulation 2, clip_grad_norm_ 1.0 at the sync points, warmup +
linear schedule, decay / no-decay groups), run with Accelerator + DDP + torch AdamW and with ZeroAccelerator +
ZeroAdam on the same arguments: `accelerate launch` (its torchrun launcher: 2 CPU processes, gloo) runs
stages 1-3, bf16 and LoRA both ways, fp16, a save_state and save_model, the errors that need two ranks,
and examples/accelerate_nlp_example.py as a script;
torchrun on 1 process loads that state at another world size and stage, and checks the single-process
errors. (A plain Accelerator on one process, with no DDP to wrap the model, moves ZeroAdam's state and
meets ChunkedTensor's error naming ZeroAccelerator: tests/test_checkpoint_format.py.)"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from harness import launch_env
from tolerances import fp32_tol, lp_param_tol, norm_rel_tol

# Present, not imported here (peft alone is 9 s of a process: every pytest-xdist worker collects this
# module, and only one runs it; the launches import them).
for _package in ("accelerate", "peft"):
    if importlib.util.find_spec(_package) is None:
        pytest.skip(f"{_package} is not installed", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "jobs", "accelerate_job.py")
STEPS, SAVE_AT = 4, 2  # accelerate_job.STEPS, SAVE_AT
NUMEL = 8_000  # at least the 2-layer GPT-2's parameters (7.6k): the norm's terms
# Parameters: fp32_tol (tests/tolerances.py), the argument of every multi-rank test. Logged loss and
# gradient norm: computed from parameters that differ by at most fp32_tol(step) relative to their scale; in
# this 2-layer model a relative parameter change reaches the loss through at most 8 chained products
# (2 layers x (attention: 2, MLP: 2)), each carrying it once; the norm also sums its NUMEL squares in
# another order (norm_rel_tol).
LOG_REL = 8 * fp32_tol(STEPS) + norm_rel_tol(NUMEL)
# bf16 both ways: Accelerate's autocast (fp32 weights, bf16 matmul inputs) against ZeroAdam's bf16 weights
# with an fp32 master. Each rounds what the forward reads to bf16 (2^-7 relative), so each run's loss is
# within 8 such roundings (the 8 chained products above) of the fp32 loss, and the two within 16.
BF16_LOG_REL = 16 * 2.0**-7


def _launch(cmd, timeout=600):
    out = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("accelerate"))
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    accelerate += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    _launch(accelerate + [JOB, "train", out])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    _launch(torchrun + [JOB, "resume", out])
    with open(os.path.join(out, "train.json")) as f, open(os.path.join(out, "resume.json")) as g:
        return out, json.load(f), json.load(g)


def _load(out, name):
    return torch.load(os.path.join(out, f"{name}.pt"), weights_only=True)


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _close_logs(mine, theirs, where, rel=LOG_REL):
    assert len(mine) == len(theirs), where
    for (loss, norm, lr), (loss0, norm0, lr0) in zip(mine, theirs):
        assert lr == lr0, f"{where}: the schedule differs ({lr} vs {lr0})"
        assert abs(loss - loss0) <= rel * abs(loss0), f"{where}: loss {loss} vs {loss0}"
        assert abs(norm - norm0) <= rel * abs(norm0), f"{where}: gradient norm {norm} vs {norm0}"


def test_the_same_loop_with_zero_accelerator_equals_accelerator_with_ddp(jobs):
    out, res, _ = jobs
    assert res["world"] == 2
    ddp = res["ddp"]
    assert (ddp["model"], ddp["inner"]) == ("DistributedDataParallel", "AdamW")  # the oracle ran DDP
    for stage in (1, 2, 3):
        r = res[f"zero{stage}"]
        # never wrapped; ZeroAdam behind Accelerate's optimizer wrapper, its own methods reachable through it
        assert (r["model"], r["inner"]) == ("GPT2LMHeadModel", "ZeroAdam"), r
        assert r["report_units"] == (2 if stage == 3 else 0), r
        assert r["keys"] == ddp["keys"], r  # get_state_dict: every entry, whole
        _close_logs(r["logs"], ddp["logs"], f"stage {stage}")
        d = _max_diff(_load(out, f"zero{stage}"), _load(out, "ddp"))
        assert d <= fp32_tol(STEPS), f"stage {stage}: parameters {d:.3g} from Accelerator + DDP"


def test_bf16_is_zero_adams_mixed_precision(jobs):
    out, res, _ = jobs
    r, ddp = res["zero3-bf16"], res["ddp-bf16"]
    assert (r["mixed_precision"], r["dtype"]) == ("bf16", "torch.bfloat16"), r  # the model itself in bf16
    assert (ddp["mixed_precision"], ddp["dtype"]) == ("bf16", "torch.float32"), ddp  # autocast over fp32
    _close_logs(r["logs"], ddp["logs"], "bf16", rel=BF16_LOG_REL)
    # The bf16 tolerance of every test that compares against an fp32 run (tests/tolerances.py).
    theirs = _load(out, "ddp-bf16")
    d = _max_diff(_load(out, "zero3-bf16"), theirs)
    assert d <= lp_param_tol(torch.bfloat16, STEPS, theirs), f"bf16: parameters {d:.3g} from Accelerate's autocast"


def test_fp16_is_zero_adams_with_its_loss_scale(jobs):
    """fp16 (which Accelerate's own path runs with a GradScaler on a GPU): ZeroAdam's fp16 model and loss
    scaling. Each loss within 8 fp16 roundings (2^-10 relative: the 8 chained products) of the fp32 run's."""
    _, res, _ = jobs
    r = res["zero2-fp16"]
    assert (r["mixed_precision"], r["dtype"]) == ("fp16", "torch.float16") and r["loss_scale"] > 1.0, r
    _close_logs(r["logs"], res["ddp"]["logs"], "fp16", rel=8 * 2.0**-10 + LOG_REL)


def test_lora_at_stage_3_equals_lora_with_ddp(jobs):
    out, res, _ = jobs
    assert res["zero3-lora"]["model"] == "PeftModelForCausalLM"
    _close_logs(res["zero3-lora"]["logs"], res["ddp-lora"]["logs"], "LoRA")
    d = _max_diff(_load(out, "zero3-lora"), _load(out, "ddp-lora"))
    assert d <= fp32_tol(STEPS), f"LoRA adapters {d:.3g} from Accelerator + DDP"


def test_load_state_continues_on_another_world_size_and_stage(jobs):
    """save_state after step 2 on 2 ranks at stage 3; load_state in a fresh launch on 1 process, at stage 3
    and at stage 2: the last two steps as the uninterrupted run's. The folder holds Accelerate's files
    (RNG, scheduler) and the zerofast checkpoint, no whole-model or optimizer file."""
    out, res, resumed = jobs
    assert resumed["world"] == 1
    files = set(os.listdir(os.path.join(out, "state")))
    assert {"zerofast", "scheduler.bin", "random_states_0.pkl", "random_states_1.pkl"} <= files, files
    assert not files & {"model.safetensors", "optimizer.bin"}, files
    straight = _load(out, "zero3")
    for stage in (3, 2):
        _close_logs(resumed[f"stage{stage}"]["logs"], res["zero3"]["logs"][SAVE_AT:], f"resumed at stage {stage}")
        d = _max_diff(_load(out, f"resumed{stage}"), straight)
        assert d <= fp32_tol(STEPS), f"resumed at stage {stage}: {d:.3g} from the uninterrupted run"


def test_save_model_loads_with_from_pretrained(jobs):
    from transformers import GPT2LMHeadModel

    out, res, _ = jobs
    assert res["zero3"]["saved"] == ["config.json", "model.safetensors"]
    model = GPT2LMHeadModel.from_pretrained(os.path.join(out, "saved"))
    loaded = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied to wte
    trained = {k: v for k, v in _load(out, "zero3").items() if k in loaded}
    assert trained.keys() == loaded.keys()
    assert _max_diff(loaded, trained) == 0.0  # the stage-3 model, whole, as trained
    assert torch.equal(model.lm_head.weight, model.transformer.wte.weight)


def test_errors_are_named(jobs):
    _, res, resumed = jobs
    errors = {**res["errors"], **resumed["errors"]}
    expected = {
        "torch optimizer": "ValueError: ZeroAccelerator: prepare got a AdamW on 2 processes",
        "backward without ZeroAdam": "RuntimeError: ZeroAccelerator: backward on 2 processes with no ZeroAdam",
        "second ZeroAdam": "ValueError: ZeroAccelerator: a second ZeroAdam was prepared",
        "fsdp plugin": "ValueError: ZeroAccelerator: fsdp_plugin= hands the model to another sharding engine",
        "fp8": "ValueError: ZeroAccelerator: mixed_precision must be one of 'no', 'bf16', 'fp16'",
        "precision": "ValueError: ZeroAccelerator: mixed_precision='bf16'",
    }
    for key, start in expected.items():
        assert errors[key].startswith(start), (key, errors[key])
    assert "mixed_precision=accelerator.mixed_precision" in errors["precision"]
    # A plain Accelerator given a ZeroAdam: its prepare() wraps the model in DDP, which fails naming ZeroAccelerator.
    for key in ("plain Accelerator, stage 1", "plain Accelerator, stage 2", "plain Accelerator, stage 3"):
        assert errors[key].startswith("ModelConversionError: torch.nn.parallel.DistributedDataParallel"), errors[key]
        assert "zerofast.integrations.accelerate.ZeroAccelerator" in errors[key]
    assert resumed["from the environment"] == "fp16"  # ACCELERATE_MIXED_PRECISION, as `accelerate config` sets it


EXAMPLE = os.path.join(ROOT, "examples", "accelerate_nlp_example.py")
MARK = "# zerofast (Accelerate's line: "


def plain_accelerate_version(source: str) -> tuple[str, int]:
    """The example as Accelerate's own script has it: each line after a mark replaced by the line the mark
    gives (same indentation), the marks dropped; and how many lines changed."""
    lines, out, changed = source.splitlines(), [], 0
    for i, line in enumerate(lines):
        if line.strip().startswith(MARK):
            continue
        if i and lines[i - 1].strip().startswith(MARK):
            original = lines[i - 1].strip()[len(MARK) : -1]
            line = line[: len(line) - len(line.lstrip())] + original
            changed += 1
        out.append(line)
    return "\n".join(out) + "\n", changed


def test_the_example_is_accelerates_script_with_three_lines_changed_and_trains(jobs):
    with open(EXAMPLE) as f:
        source = f.read()
    plain, changed = plain_accelerate_version(source)
    assert changed == 3, changed
    assert "zerofast" not in plain.split('"""', 2)[2]  # below the docstring, nothing of zerofast is left
    compile(plain, "plain_accelerate_example.py", "exec")  # and it is a whole script
    with open(os.path.join(jobs[0], "example.json")) as f:  # run as a script by the `accelerate launch` job
        history = json.load(f)
    assert len(history) == 2 and history[1]["train_loss"] < history[0]["train_loss"], history
    assert history[-1]["accuracy"] == 1.0, history  # the pairs' first token is their label
