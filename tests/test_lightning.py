"""zerofast.integrations.lightning: ZeroStrategy in real launches on CPU (gloo), against Lightning's own
path, DDPStrategy with the same module, data and Trainer flags (accumulate_grad_batches=2,
gradient_clip_val=1.0, AdamW over decay / no-decay groups with a warmup schedule stepped each
optimizer step; tests/jobs/lightning_job.py runs the jobs). Launches: the train job on 2 ranks with
Lightning's own launcher (`python script.py`), resumes in fresh launches on 2 and on 3 ranks, and
the pytorch_lightning package under torchrun (also with the optimizer state offloaded, offload=).
The argument errors are checked in this process."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from tolerances import fp32_tol

# Lightning is imported by the tests that use it (10 s of a process: every pytest-xdist worker
# collects this module, and only one runs it).
if importlib.util.find_spec("lightning") is None:
    pytest.skip("lightning is not installed", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "jobs", "lightning_job.py")
STEPS = 12  # lightning_job: 3 epochs x 4 optimizer steps
# Parameters: fp32_tol (tests/tolerances.py), the argument of every multi-rank test: per step the reduced
# gradients differ by the rounding of a sum of N <= 3 terms in another order. Logged losses and the
# validation loss: computed from parameters that differ by at most fp32_tol(STEPS) relative to their
# scale (1.0, the layer norms); in Nested a relative change reaches the loss through at most 8 chained
# products (3 blocks x 2 linears, the embedding, the tied head), each carrying it once.
LOSS_REL = 8 * fp32_tol(STEPS)


def _launch(nproc, *args, torchrun=False, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
    cmd = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), JOB]
        if torchrun
        else [sys.executable, JOB]
    )  # Lightning's launcher starts the other processes
    out = subprocess.run(cmd + list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("lightning"))
    _launch(2, "train", out, "2")
    _launch(2, "resume", out, "2")
    _launch(3, "resume", out, "3")
    _launch(2, "torchrun", out, torchrun=True)
    return out


def _json(out, name):
    with open(os.path.join(out, f"{name}.json")) as f:
        return json.load(f)


def _params(out, name):
    return torch.load(os.path.join(out, f"{name}.pt"), weights_only=True)


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _close(mine, theirs, where, steps=STEPS, same_rank_batches=True):
    """Same logged losses (each micro-batch's on rank 0: comparable where rank 0 had the same batches),
    validation loss (over the whole validation set) and step count as the oracle run."""
    assert len(mine["losses"]) == len(theirs["losses"]) > 0, where
    for i, (a, b) in enumerate(zip(mine["losses"], theirs["losses"])):
        if same_rank_batches:
            assert abs(a - b) <= LOSS_REL * abs(b), f"{where}: micro-batch {i} loss {a} vs {b}"
    if theirs["val_loss"] is not None:
        assert abs(mine["val_loss"] - theirs["val_loss"]) <= LOSS_REL * abs(theirs["val_loss"]), where
    assert mine["global_step"] == theirs["global_step"], where


def test_zero_strategy_stages_equal_ddp_strategy(jobs):
    res = _json(jobs, "train")
    assert res["ddp"]["wrapped"] == "DistributedDataParallel" and res["ddp"]["optimizer"] == "AdamW"  # the oracle
    ddp = _params(jobs, "train-ddp")
    for stage in (1, 2, 3):
        r = res[f"stage{stage}"]
        assert r["wrapped"] == "Lit" and r["optimizer"] == "ZeroAdam", r  # never DDP; the AdamW became ZeroAdam
        _close(r, res["ddp"], f"stage {stage}")
        d = _max_diff(_params(jobs, f"train-stage{stage}"), ddp)
        assert d <= fp32_tol(STEPS), f"stage {stage}: parameters {d:.3g} from DDPStrategy"


def test_clip_by_value_across_shards_equals_ddp(jobs):
    res = _json(jobs, "train")
    _close(res["stage2-value"], res["ddp-value"], "clip by value", steps=4)
    d = _max_diff(_params(jobs, "train-stage2-value"), _params(jobs, "train-ddp-value"))
    assert d <= fp32_tol(4), f"clip by value: parameters {d:.3g} from DDPStrategy"


def test_manual_optimization_stage3_equals_ddp(jobs):
    res = _json(jobs, "train")
    _close(res["stage3-manual"], res["ddp-manual"], "manual optimization", steps=8)
    d = _max_diff(_params(jobs, "train-stage3-manual"), _params(jobs, "train-ddp-manual"))
    assert d <= fp32_tol(8), f"manual optimization: parameters {d:.3g} from DDPStrategy"


@pytest.mark.parametrize("name", ["stage3-bf16", "stage2-fp16"])
def test_precision_flags_are_zeroadams_mixed_precision(jobs, name):
    """precision="bf16-mixed" / "16-true" with a ZeroAdam from configure_optimizers: bitwise the same
    ZeroAdam in its own loop (the same kernels on the same data in the same order; fp16 through
    opt.backward's loss scale, no second scaler), loss scale included."""
    res = _json(jobs, "train")
    assert res[name]["losses"] == res[f"own-{name}"]["losses"]
    assert res[name]["loss_scale"] == res[f"own-{name}"]["loss_scale"]
    assert _max_diff(_params(jobs, f"train-{name}"), _params(jobs, f"train-own-{name}")) == 0.0
    if name == "stage2-fp16":
        assert res[name]["loss_scale"] < 2.0**16  # the scale backed off: overflowing steps were skipped


def test_validation_predict_and_checkpoint_files_in_stage3(jobs):
    from zerofast.integrations import _lightning as core

    res = _json(jobs, "train")["stage3"]
    # trainer.validate after fit, on the sharded module, equals the fit's last validation loop
    assert res["validate"] == res["val_loss"]
    assert len(res["predict"]) == 1 and len(res["predict"][0]) == 3  # one batch of 3 sequences on rank 0
    assert res["files"] == [core.LIGHTNING_FILE, core.ZERO_DIR]
    # ModelCheckpoint's last.ckpt, replaced at every save; nothing left of the writes
    assert res["ckpts"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"]
    ckpt = os.path.join(jobs, "ckpt-stage3", "epoch=2-step=12.ckpt")
    # Lightning's state beside the shards, without the module's weights (not materialised whole)
    state = torch.load(os.path.join(ckpt, core.LIGHTNING_FILE), weights_only=False)
    assert "state_dict" not in state and state["global_step"] == 12 and "loops" in state and state["lr_schedulers"]
    # the shards: every rank's piece, a zerofast checkpoint that reads back as the trained model
    from zerofast.checkpoint import to_torch

    model, _ = to_torch(os.path.join(ckpt, core.ZERO_DIR))
    trained = _params(jobs, "train-stage3")
    assert _max_diff({k: model[k].float() for k in trained}, trained) == 0.0
    last, _ = to_torch(os.path.join(jobs, "ckpt-stage3", "last.ckpt", core.ZERO_DIR))
    assert _max_diff({k: last[k].float() for k in trained}, trained) == 0.0
    # save_full_weights=True: the whole state_dict (gathered unit by unit) in lightning.ckpt as well
    full = torch.load(os.path.join(jobs, "full.ckpt", core.LIGHTNING_FILE), weights_only=False)["state_dict"]
    assert _max_diff({k: full[k].float() for k in trained}, trained) == 0.0


def test_resume_in_a_fresh_launch_equals_the_uninterrupted_run(jobs):
    """From the checkpoint ModelCheckpoint wrote after epoch 0: stage 3 from a stage-2 checkpoint,
    stage 2 from DDPStrategy's plain Lightning checkpoint (weights and AdamW state converted), both on
    2 ranks; stage 1 on 3 ranks from a 2-rank stage-3 checkpoint. Each equals the uninterrupted run."""
    train, two, three = _json(jobs, "train"), _json(jobs, "resume2"), _json(jobs, "resume3")
    for name, res, ref in (
        ("stage3-from-stage2", two, "stage2"),
        ("stage2-from-ddp", two, "ddp"),
        ("stage1-from-stage3", three, "stage3"),
    ):
        mine, theirs = res[name], dict(train[ref], losses=train[ref]["losses"][8:])  # epochs 1-2
        # at 3 ranks rank 0 holds 2 of each step's 6 sequences, not 3: the same global batch, other local ones
        _close(mine, theirs, name, same_rank_batches=res is two)
        d = _max_diff(_params(jobs, f"resume-{name}"), _params(jobs, f"train-{ref}"))
        assert d <= fp32_tol(STEPS), f"{name}: parameters {d:.3g} from the uninterrupted run"
    # validate(ckpt_path=...) with no fit: the whole model on each rank from the shards
    assert abs(two["validate-only"] - train["stage3"]["val_loss"]) <= LOSS_REL * abs(train["stage3"]["val_loss"])


def test_pytorch_lightning_under_torchrun(jobs):
    res = _json(jobs, "torchrun")
    assert res["stage3"]["optimizer"] == "ZeroAdam"
    _close(res["stage3"], res["ddp"], "pytorch_lightning stage 3", steps=4)
    d = _max_diff(_params(jobs, "torchrun-stage3"), _params(jobs, "torchrun-ddp"))
    assert d <= fp32_tol(4), f"pytorch_lightning: parameters {d:.3g} from DDPStrategy"


def test_offload_passes_through_to_zero_adam(jobs):
    """ZeroStrategy(offload="disk:PATH") (the torchrun job): ZeroAdam's state in files under PATH, and
    the run equals the same run in memory bitwise (losses, validation loss, parameters); the files
    are gone when the job ends. With the delayed update, nothing is left in flight after fit()."""
    res = _json(jobs, "torchrun")
    disk, memory = res["stage3-disk"], res["stage3"]
    state, under, read = disk["offload"]
    assert state == "disk" and under and read > 0, disk["offload"]
    assert disk["losses"] == memory["losses"] and disk["val_loss"] == memory["val_loss"]
    assert _max_diff(_params(jobs, "torchrun-stage3-disk"), _params(jobs, "torchrun-stage3")) == 0.0
    assert os.listdir(os.path.join(jobs, "offload")) == []
    # OffloadPolicy(delayed_update=True): fit() returns with the last step's update applied
    assert res["stage2-delayed"] == {"in flight": False, "steps": 4}, res["stage2-delayed"]


def test_unsupported_optimizers_get_named_errors(jobs):
    errors = _json(jobs, "train")["errors"]
    assert errors["sgd"].startswith("TypeError: ZeroStrategy: configure_optimizers returned torch.optim.sgd.SGD")
    assert "torch.optim.AdamW or torch.optim.Adam" in errors["sgd"]
    assert errors["both"].startswith("ValueError: ZeroStrategy: stage given to ZeroStrategy and a ZeroAdam")


# --- argument errors, in this process (no launch) ---------------------------------------------------


def test_strategy_argument_errors():
    import lightning.pytorch as pl

    from zerofast.integrations.lightning import ZeroStrategy

    with pytest.raises(TypeError, match="unexpected argument 'find_unused_parameters'"):
        ZeroStrategy(stage=2, find_unused_parameters=True)
    with pytest.raises(TypeError, match="save_async must be a bool; got 'yes'"):
        ZeroStrategy(stage=2, save_async="yes")
    with pytest.raises(ValueError, match="stage"):
        ZeroStrategy(stage=4)
    with pytest.raises(ValueError, match="units"):
        ZeroStrategy(stage=1, units=[torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="shard_size must be None or an integer >= 1; got 0"):
        ZeroStrategy(shard_size=0)
    with pytest.raises(
        ValueError, match="offload must be None, 'host', 'disk:PATH', 'infinity:PATH' or an OffloadPolicy; got 'nvme'"
    ):
        ZeroStrategy(offload="nvme")
    with pytest.raises(TypeError, match="save_full_weights must be a bool; got 'yes'"):
        ZeroStrategy(save_full_weights="yes")
    with pytest.raises(ValueError, match="precision='64-true' is not supported"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(), precision="64-true", logger=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=3),
        precision="bf16-true",
        logger=False,
        enable_checkpointing=False,
    )
    plugin = trainer.strategy.precision_plugin
    assert type(plugin).__name__ == "ZeroPrecision" and plugin.dtype == torch.bfloat16
    batch = plugin.convert_input((torch.zeros(2), torch.zeros(2, dtype=torch.long)))
    assert batch[0].dtype == torch.bfloat16 and batch[1].dtype == torch.long


def test_optimizer_conversion_errors_name_the_problem():
    from zerofast.integrations import _lightning as core

    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"AdamW.param_groups\[0\] has amsgrad=True"):
        core.zero_from(torch.optim.AdamW(module.parameters(), amsgrad=True), module, None, {})
    with pytest.raises(ValueError, match=r"1.weight is trainable .* in no parameter group of the AdamW \(2 such\)"):
        core.zero_from(torch.optim.AdamW(module[0].parameters()), module, None, {})
    with pytest.raises(TypeError, match="returned torch.optim.adagrad.Adagrad"):
        core.zero_from(torch.optim.Adagrad(module.parameters()), module, None, {})
