"""zerofast.integrations.hf: ZeroTrainer (transformers.Trainer with ZeroAdam) in real launches,
2 CPU ranks under torchrun (gloo), against the framework's own path, Trainer + DDP with its AdamW,
on the same arguments: accumulation 2, clipping 1.0, warmup + linear schedule, weight decay
(tests/jobs/hf_job.py runs the jobs). Also: the optimizer state on disk (zero={"offload": ...});
resuming checkpoint-2 in a fresh launch, at another stage and at another world size; save_model()
loaded by from_pretrained; LoRA (peft) in stage 3 with gradient checkpointing; TRL's SFTTrainer
with the mixin; the clear errors, a step skipped on an fp16 overflow and train() with the delayed
update (one process)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from harness import launch_env
from tolerances import fp32_tol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "jobs", "hf_job.py")
STEPS = 4  # hf_job.STEPS
# Parameters: fp32_tol (tests/tolerances.py): the same argument as every multi-rank test. Logged loss
# and grad_norm: computed from parameters that differ by at most fp32_tol(step) relative to their
# scale; in these 2-layer models a relative parameter change reaches the loss through at most 8
# chained products (2 layers x (attention: 2, MLP: 2)), each carrying it once: 8 x fp32_tol(STEPS)
# relative, plus the norm's own reordering (a sum of squares in another order, norm_rel_tol(numel)).
LOG_REL = 8 * fp32_tol(STEPS) + 40_000 * 2.0**-24


def _launch(nproc, *args, timeout=600):
    env = launch_env()
    cmd = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        if nproc > 1
        else [sys.executable]
    )
    out = subprocess.run(cmd + [JOB, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """One training launch, then two resume launches (stage 2 on 2 ranks, stage 1 on 1 rank)."""
    pytest.importorskip("accelerate")
    pytest.importorskip("peft")
    out = str(tmp_path_factory.mktemp("hf"))
    _launch(2, "train", out)
    _launch(2, "resume", out, "2")
    _launch(1, "resume", out, "1")
    return out


def _load(out, name):
    return torch.load(os.path.join(out, name), weights_only=True)


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _close_logs(mine, theirs, where):
    assert len(mine) == len(theirs) == STEPS, where
    for (loss, norm, lr), (loss0, norm0, lr0) in zip(mine, theirs):
        assert lr == lr0, f"{where}: the schedule differs ({lr} vs {lr0})"
        assert abs(loss - loss0) <= LOG_REL * abs(loss0), f"{where}: loss {loss} vs DDP {loss0}"
        assert abs(norm - norm0) <= LOG_REL * abs(norm0), f"{where}: grad_norm {norm} vs DDP {norm0}"


def test_zero_trainer_stages_equal_trainer_with_ddp(jobs):
    with open(os.path.join(jobs, "train.json")) as f:
        res = json.load(f)
    assert res["ddp"]["wrapped"] == "DistributedDataParallel"  # the oracle ran DDP
    ddp = _load(jobs, "train-ddp.pt")
    for stage in ("1", "2", "3"):
        r = res[stage]
        assert r["wrapped"] == "GPT2LMHeadModel" and r["optimizer"] == "ZeroAdam", r  # never DDP
        _close_logs(r["logs"], res["ddp"]["logs"], f"stage {stage}")
        d = _max_diff(_load(jobs, f"train-stage{stage}.pt"), ddp)
        assert d <= fp32_tol(STEPS), f"stage {stage}: parameters {d:.3g} from Trainer + DDP"
    evals = [res[s]["eval_loss"] for s in ("1", "2", "3")]
    assert max(evals) - min(evals) <= LOG_REL * max(evals), evals
    assert res["3"]["predictions"] == [4, 16, 96]


def test_offload_in_zero_passes_through_to_zero_adam(jobs):
    """zero={"stage": 2, "offload": "disk:PATH"}: ZeroAdam's state in files under PATH, and the run
    equals the same ZeroTrainer in memory bitwise (logged loss, grad_norm, learning rate, parameters);
    the files are gone when the job ends."""
    with open(os.path.join(jobs, "train.json")) as f:
        res = json.load(f)
    state, under, read = res["stage2-disk"]["offload"]
    assert state == "disk" and under and read > 0, res["stage2-disk"]
    assert res["stage2-disk"]["logs"] == res["2"]["logs"]
    assert _max_diff(_load(jobs, "train-stage2-disk.pt"), _load(jobs, "train-stage2.pt")) == 0.0
    assert os.listdir(os.path.join(jobs, "offload")) == []


def test_bf16_and_fp16_are_zero_adams_mixed_precision(jobs):
    with open(os.path.join(jobs, "train.json")) as f:
        res = json.load(f)
    fp32 = res["2"]["logs"]
    for flag, dtype, ulp in (("bf16", "torch.bfloat16", 2.0**-7), ("fp16", "torch.float16", 2.0**-10)):
        r = res["precision"][flag]
        assert r["dtype"] == dtype and r["mixed_precision"] == flag, r
        assert r["accelerate"] == ["no", False], r  # no autocast, no GradScaler from Accelerate
        assert (r["loss_scale"] > 1.0) == (flag == "fp16"), r  # ZeroAdam's own loss scaling, fp16 only
        # The same training in that dtype: each loss within 8 ulps of the dtype (LOG_REL's 8 chained
        # products, each rounding once in the low-precision forward) of the fp32 run's.
        for (loss, _, lr), (loss0, _, lr0) in zip(r["logs"], fp32):
            assert lr == lr0 and abs(loss - loss0) <= 8 * ulp * abs(loss0), (flag, loss, loss0)


def test_checkpoint_holds_zerofast_shards_beside_the_trainers_files(jobs):
    """Written in the background (save_async=True): complete when train() returns."""
    with open(os.path.join(jobs, "train.json")) as f:
        stage3 = json.load(f)["3"]
    files = stage3["checkpoint"]
    assert stage3["last checkpoint complete when train() returned"]
    assert {"zerofast", "scheduler.pt", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"} <= set(files)
    assert "optimizer.pt" not in files
    assert {"manifest.json", "__0_0.distcp", "__1_0.distcp"} <= set(
        os.listdir(os.path.join(jobs, "stage3", "checkpoint-2", "zerofast"))
    )


def test_resume_in_a_fresh_launch_at_another_stage_and_world_size(jobs):
    """checkpoint-2 of the stage-3 run, resumed to the end: at stage 2 on 2 ranks and at stage 1 on
    one process, each equal to the uninterrupted run."""
    uninterrupted = _load(jobs, "train-stage3.pt")
    for name in ("resume-stage2-world2.pt", "resume-stage1-world1.pt"):
        d = _max_diff(_load(jobs, name), uninterrupted)
        assert d <= fp32_tol(STEPS), f"{name}: {d:.3g} from the uninterrupted run"


def test_save_model_loads_with_from_pretrained(jobs):
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(os.path.join(jobs, "final"))
    trained = _load(jobs, "train-stage3.pt")
    assert _max_diff({n: p.detach() for n, p in model.named_parameters()}, trained) == 0.0
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # still tied


def test_lora_stage3_equals_ddp_and_saves_the_trained_adapter(jobs):
    with open(os.path.join(jobs, "train.json")) as f:
        res = json.load(f)["lora"]
    _close_logs(res["zero"], res["ddp"], "LoRA stage 3 with gradient checkpointing")
    # The frozen base is sharded: after a step a rank holds about (all parameters) / 2, plus padding
    # (each unit's trainable and frozen buckets padded to world x ALIGN = 8 elements of 4 bytes).
    assert res["param_bytes"] <= res["all_bytes"] / 2 + res["units"] * 2 * 8 * 4, res
    mine, ddp = _load(jobs, "train-lora-zero.pt"), _load(jobs, "train-lora-ddp.pt")
    assert mine and all("lora_" in n for n in mine)
    assert _max_diff(mine, ddp) <= fp32_tol(STEPS)
    from safetensors.torch import load_file

    saved = load_file(os.path.join(jobs, "lora-adapter", "adapter_model.safetensors"))
    assert len(saved) == len(mine)
    for name, value in saved.items():  # PEFT's names drop the adapter name: match by suffix
        key = next(k for k in mine if k.replace(".default", "").endswith(name.removeprefix("base_model.model.")))
        assert value.numel() > 0 and torch.equal(value.float(), mine[key]), name  # not an empty stage-3 tensor


def test_trl_sft_trainer_with_the_mixin_trains():
    if importlib.util.find_spec("trl") is None:
        pytest.skip("trl is not installed (the Makefile pins it; it installs from the registry)")
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        _launch(2, "sft", out)
        with open(os.path.join(out, "sft.json")) as f:
            res = json.load(f)
    assert res["optimizer"] == "ZeroAdam" and len(res["logs"]) == 3
    assert all(torch.isfinite(torch.tensor(entry[:2])).all() for entry in res["logs"])


def test_resume_true_skips_a_checkpoint_whose_shards_were_never_completed(tmp_path):
    """train(resume_from_checkpoint=True) takes the highest checkpoint-N that is complete: not one
    whose zerofast/ is still .incomplete (a run killed during an asynchronous save), nor one killed
    before the Trainer wrote its state; a plain Trainer's (no zerofast/) counts."""
    from zerofast.integrations.hf import last_complete_checkpoint

    def make(step, *files):
        for f in files:
            path = tmp_path / f"checkpoint-{step}" / f
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("{}")

    make(2, "trainer_state.json", "zerofast/manifest.json")
    make(4, "trainer_state.json", "zerofast.incomplete/__0_0.distcp")
    make(5, "trainer_state.json", "scheduler.pt")  # the shards' folder removed after a failed write
    make(6, "model.safetensors")
    with pytest.warns(UserWarning) as seen:
        assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    assert [str(w.message).split()[1].rsplit("/", 1)[-1] for w in seen] == [
        "checkpoint-6",
        "checkpoint-5",
        "checkpoint-4",
    ]
    make(8, "trainer_state.json", "optimizer.pt")  # a plain Trainer's
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-8")
    assert last_complete_checkpoint(str(tmp_path / "nothing")) is None


# Bad combinations named before any training, a step skipped on an fp16 overflow, and train() with
# the delayed update, all through the real Trainer in one process (a group of one): one interpreter
# for all (about 10 s, most of it importing transformers).
ONE_PROCESS = r"""
import json, torch, torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from zerofast import LossScalePolicy, MixedPrecisionPolicy
from zerofast.integrations.hf import ZeroTrainer
m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
def args(**kw):
    return TrainingArguments(output_dir="/tmp/zf-hf-one-process", use_cpu=True, report_to=[], **kw)
cases = [
    (lambda: ZeroTrainer(model=m, args=args(), optimizers=(torch.optim.AdamW(m.parameters()), None), zero={}),
     "optimizers=(AdamW, ...) next to zero="),
    (lambda: ZeroTrainer(model=m, args=args(), zero={"lr": 1.0}), "is set by TrainingArguments (learning_rate)"),
    (lambda: ZeroTrainer(model=m, args=args(optim="sgd"), zero={}), "optim='sgd'"),
    (lambda: ZeroTrainer(model=m, args=args(fsdp="full_shard"), zero={}), "FSDP are exclusive"),
    (lambda: ZeroTrainer(model=m, args=args(bf16=True), zero={"mixed_precision": "fp16"}), "disagrees"),
    (lambda: ZeroTrainer(model=m, args=args(), zero=3), "zero must be a dict"),
    (lambda: ZeroTrainer(model=m, args=args(), zero={}, save_async=1), "save_async must be True or False; got 1"),
]
errors = []
for make, message in cases:
    try:
        make()
        errors.append([message, "no error"])
    except (ValueError, TypeError) as e:
        errors.append([message, str(e)])

class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        x = torch.arange(8) % 32
        return {"input_ids": x, "labels": x}

# A loss scale of 2^40 overflows fp16's gradients at every one of the 2 steps (it halves each time):
# each step is skipped, and the Trainer then holds the schedule, as it does for GradScaler's skips.
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
overflow = ZeroTrainer(
    model=model,
    args=args(fp16=True, max_steps=2, logging_steps=1, learning_rate=1e-3, lr_scheduler_type="linear",
              per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True),
    train_dataset=Tokens(),
    zero={"mixed_precision": MixedPrecisionPolicy(torch.float16, loss_scale=LossScalePolicy(init_scale=2.0**40))},
)
before = {n: p.detach().clone() for n, p in model.named_parameters()}
overflow.train()

# OffloadPolicy(delayed_update=True) in zero=: train() returns with the last step's update applied.
from zerofast import OffloadPolicy
from zerofast.optim.zero_adam import parts_of
delayed = ZeroTrainer(
    model=GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)),
    args=args(max_steps=2, per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True),
    train_dataset=Tokens(),
    zero={"offload": OffloadPolicy("host", delayed_update=True)},
)
delayed.train()
print(json.dumps({
    "delayed": [delayed.state.global_step, parts_of(delayed.optimizer).offload.update_in_flight],
    "errors": errors,
    "lrs": [h["learning_rate"] for h in overflow.state.log_history if "loss" in h],
    "skipped": overflow.accelerator.optimizer_step_was_skipped,
    "unchanged": all(torch.equal(before[n].to(p.dtype), p) for n, p in model.named_parameters()),  # in fp16 now
    "loss_scale": overflow.optimizer.loss_scale,
}))
"""


@pytest.fixture(scope="module")
def one_process():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    out = subprocess.run(
        [sys.executable, "-c", ONE_PROCESS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_clear_errors(one_process):
    """Bad combinations are named before any training."""
    for message, got in one_process["errors"]:
        assert message in got, (message, got)


def test_a_step_skipped_on_fp16_overflow_holds_the_schedule(one_process):
    """The accelerator's optimizer_step_was_skipped is ZeroAdam's: the Trainer does not step the
    schedule after a skipped step (linear from 1e-3 over 2 steps: 1e-3, then 5e-4 had it stepped)."""
    assert one_process["lrs"] == [1e-3, 1e-3], one_process
    assert one_process["skipped"] and one_process["unchanged"], one_process
    assert one_process["loss_scale"] == 2.0**38, one_process  # backed off at each of the 2 skipped steps


def test_train_returns_with_the_delayed_update_applied(one_process):
    """zero={"offload": OffloadPolicy("host", delayed_update=True)}: the last step's update, still
    running when the Trainer's loop ends, is applied before train() returns."""
    assert one_process["delayed"] == [2, False], one_process
