"""torch.optim's contract and the small promises around it: step(closure), a clear
error for add_param_group, profiler ranges, the estimator's command line."""

import dataclasses
import subprocess
import sys

import pytest
import torch
from harness import run_ranks
from tolerances import HYPER
from training import rank_batch

from zerofast import ZeroAdam
from zerofast.tools.estimate import main as estimate_main
from zerofast.tools.models import make_gpt
from zerofast.tools.quantities import parse_count


def _closure_and_plain(rank, world):
    out = {}
    for how in ("closure", "plain"):
        model = make_gpt("tiny")
        opt = ZeroAdam(model, stage=2, **HYPER)
        losses = []
        for step in range(3):
            batch = rank_batch(model, step, rank)
            if how == "closure":

                def closure():
                    opt.zero_grad()
                    _, loss = model(*batch)
                    loss.backward()
                    return loss

                with torch.no_grad():  # step() runs the closure under enable_grad, as torch's optimizers do
                    losses.append(opt.step(closure).item())
            else:
                opt.zero_grad()
                _, loss = model(*batch)
                loss.backward()
                assert opt.step() is None
                losses.append(loss.item())
        out[how] = (losses, {n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def test_step_with_closure_returns_its_loss_and_equals_the_plain_loop():
    for out in run_ranks(_closure_and_plain, 2):
        (closure_losses, closure_params), (plain_losses, plain_params) = out["closure"], out["plain"]
        assert closure_losses == plain_losses  # the same computation: bitwise
        assert all(torch.equal(closure_params[n], plain_params[n]) for n in plain_params)


def _add_param_group(rank, world):
    model = make_gpt("tiny")
    opt = ZeroAdam(model, stage=1, **HYPER)
    try:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    except RuntimeError as e:
        return str(e), len(opt.param_groups)
    return None, len(opt.param_groups)


def test_add_param_group_after_construction_is_an_error():
    for message, groups in run_ranks(_add_param_group, 1):
        assert message is not None and "fixed at construction" in message and "param_groups=" in message
        assert groups == 1


def _profiled(rank, world, stage):
    model = make_gpt("tiny")
    opt = ZeroAdam(model, stage=stage, **HYPER)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _, loss = model(*rank_batch(model, 0, rank))
        loss.backward()
        opt.step()
    return sorted({e.name for e in prof.events() if e.name.startswith("zerofast::")})


@pytest.mark.parametrize(
    "stage, expected",
    [
        (2, ["zerofast::adam", "zerofast::gather", "zerofast::reduce"]),
        (3, ["zerofast::adam", "zerofast::reduce", "zerofast::unit_gather"]),
    ],
)
def test_profiler_shows_where_a_step_goes(stage, expected):
    for names in run_ranks(_profiled, 2, args=(stage,)):
        assert set(expected) <= set(names), names


@pytest.mark.parametrize(
    "text, count",
    [
        ("7000000", 7_000_000),
        ("7_000_000", 7_000_000),
        ("7e9", 7 * 10**9),
        ("7.5e9", 7_500_000_000),
        ("7.5B", 7_500_000_000),
        ("350M", 350_000_000),
        ("1.2T", 1_200_000_000_000),
        ("125k", 125_000),
        ("0", 0),
    ],
)
def test_parameter_counts_as_people_type_them(text, count):
    assert parse_count(text) == count


def test_estimator_command_line(capsys):
    out = subprocess.run(
        [sys.executable, "-m", "zerofast.estimate", "--params", "7.5B", "--world", "8"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "Φ = 7,500,000,000 parameters, N = 8 ranks" in out
    for bad in ("7.5X", "-3", "1.5e-1", "nan"):  # the same main(), in this process
        with pytest.raises(SystemExit) as exit_info:
            estimate_main(["--params", bad, "--world", "8"])
        assert exit_info.value.code == 2
        assert "--params" in capsys.readouterr().err, bad


def test_zero_adam_takes_at_most_thirteen_keywords_and_the_policies():
    """The options most people set are plain keywords; the rest travel in the policies (hybrid
    sharding's shard_size in CommPolicy; its DeviceMesh form as process_group). The 13th is offload
    (an OffloadPolicy, or its shortcuts), which issue #42 allowed."""
    import inspect

    params = inspect.signature(ZeroAdam.__init__).parameters
    named = [n for n, p in params.items() if n not in ("self", "model") and p.kind is not p.VAR_KEYWORD]
    assert len(named) <= 13, named
    assert {
        "stage",
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "param_groups",
        "max_grad_norm",
        "mixed_precision",
        "units",
        "comm",
        "process_group",
        "offload",
    } <= set(named)


def test_zero_adam_is_a_thin_front():
    """The shared front (ZeroOptimizer) holds the torch.optim surface and the order of a step: at
    most 20 public members of its own beyond torch.optim.Optimizer's, reports in one dataclass,
    checkpoints through one view. ZeroAdam and ZeroMuon are siblings over it: each adds its
    constructor (ZeroMuon also muon_names), neither is a kind of the other, and neither overrides a
    step of the front."""
    from zerofast import ZeroMuon, ZeroOptimizer

    own = {n for n in vars(ZeroOptimizer) if not n.startswith("_")} | {"model", "plan"}  # + its two attributes
    assert len(own) <= 20, sorted(own)
    assert {"report", "checkpoint_view", "step", "state_dict"} <= own
    assert ZeroAdam.__bases__ == (ZeroOptimizer,) and ZeroMuon.__bases__ == (ZeroOptimizer,)
    assert not issubclass(ZeroMuon, ZeroAdam) and not issubclass(ZeroAdam, ZeroMuon)
    assert {n for n in vars(ZeroAdam) if not n.startswith("_")} == set()
    assert {n for n in vars(ZeroMuon) if not n.startswith("_")} == {"muon_names"}
    with pytest.raises(TypeError, match="build a zerofast.ZeroAdam or zerofast.ZeroMuon"):
        ZeroOptimizer(torch.nn.Linear(2, 2))
    for front in (ZeroAdam, ZeroMuon):  # only the constructor: no step of the front is overridden
        assert {n for n in vars(front) if n.startswith("_") and not n.startswith("__")} == set()
        assert {n for n in vars(front) if n.startswith("__") and callable(vars(front)[n])} == {"__init__"}


def test_the_checkpoint_package_imports_nothing_of_the_optimizer():
    """The optimizer imports zerofast.checkpoint (its state_dict), never the other way round: the
    package reads the optimizer through its CheckpointView alone, with no import cycle to hide."""
    import ast
    import pathlib

    import zerofast.checkpoint

    found = []
    for path in pathlib.Path(zerofast.checkpoint.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                name = "." * node.level + (node.module or "")
                if name.startswith("..optim") or name.startswith("zerofast.optim"):
                    found.append(f"{path.name}: from {name} import ...")
            elif isinstance(node, ast.Import):
                found += [f"{path.name}: import {a.name}" for a in node.names if a.name.startswith("zerofast.optim")]
    assert not found, found


def test_the_estimators_take_one_signature():
    """estimate_memory and estimate_traffic take the same keywords in the same order, as ZeroAdam takes
    them (hybrid sharding inside CommPolicy); a shard_size= keyword names where it went."""
    import inspect

    from zerofast import CommPolicy
    from zerofast.estimate import estimate_memory, estimate_traffic
    from zerofast.tools.models import make_gpt

    common = ["model_or_param_count", "world", "stage", "mixed_precision", "comm", "units", "offload", "tp", "rank"]
    for fn in (estimate_memory, estimate_traffic):
        names = list(inspect.signature(fn).parameters)
        assert names[: len(common)] == common, (fn.__name__, names)
        assert all(p.kind is p.KEYWORD_ONLY for p in list(inspect.signature(fn).parameters.values())[3:-1])
    model = make_gpt("tiny")
    assert estimate_traffic(model, 4, 2, comm=CommPolicy(shard_size=2)) != estimate_traffic(model, 4, 2)
    for fn in (estimate_memory, estimate_traffic):
        with pytest.raises(TypeError, match=r"shard_size= is now comm=CommPolicy\(shard_size=...\)"):
            fn(model, 4, 2, shard_size=2)


def test_the_plan_resolves_every_default_once():
    """resolve_plan's facts per stage and precision: what each part of the optimizer acts on."""
    from zerofast import CommPolicy, MixedPrecisionPolicy
    from zerofast.config import DEFAULT_BUCKET_MB, resolve_plan

    p1, p2, p3 = (resolve_plan(s) for s in (1, 2, 3))
    assert (p1.grads_as_bucket_views, p1.grads_sharded, p1.params_sharded, p1.gather_after_step) == (
        True,
        False,
        False,
        True,
    )
    assert (p2.grads_as_bucket_views, p2.grads_sharded, p2.params_sharded, p2.gather_after_step) == (
        False,
        True,
        False,
        True,
    )
    assert (p3.grads_as_bucket_views, p3.grads_sharded, p3.params_sharded, p3.gather_after_step) == (
        False,
        True,
        True,
        False,
    )
    assert (p1.accumulates_locally, p2.accumulates_locally) == (True, False)
    assert resolve_plan(2, comm=CommPolicy(accumulate_locally=True)).accumulates_locally
    assert (p1.bucket_bytes, p2.bucket_bytes, p3.bucket_bytes) == (
        int(DEFAULT_BUCKET_MB[1] * 2**20),
        int(DEFAULT_BUCKET_MB[2] * 2**20),
        0,
    )
    assert p3.min_unit_bytes == 2 * 2**20 and p1.min_unit_bytes == 0
    bf16 = resolve_plan(1, mixed_precision="bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype, bf16.separate_master, bf16.loss_scale) == (
        torch.bfloat16,
        torch.bfloat16,
        True,
        None,
    )
    fp32_reduce = resolve_plan(1, mixed_precision=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    assert not fp32_reduce.grads_as_bucket_views  # stage 1 copies where it reduces in another dtype
    fp16 = resolve_plan(2, mixed_precision="fp16")
    assert fp16.scales_loss and fp16.loss_scale.init_scale == 2.0**16 and fp16.mixed_precision == "fp16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        p1.stage = 2


def test_errors_are_exported():
    import zerofast
    from zerofast.comm import CollectiveError, GradientError, OutOfStepError
    from zerofast.optim.grads import StepNotAppliedError

    assert (
        zerofast.CollectiveError,
        zerofast.OutOfStepError,
        zerofast.StepNotAppliedError,
        zerofast.GradientError,
    ) == (CollectiveError, OutOfStepError, StepNotAppliedError, GradientError)
    assert GradientError is zerofast._C.GradientError and issubclass(GradientError, RuntimeError)
    assert {"CollectiveError", "OutOfStepError", "StepNotAppliedError", "GradientError", "CommPolicy"} <= set(
        zerofast.__all__
    )
    from zerofast import errors

    # One home: every error class a user catches is zerofast.errors', the same class wherever it is
    # raised (the compiled core's GradientError too), and the core's are exported from zerofast.
    for name in errors.__all__:
        assert getattr(errors, name).__module__ == "zerofast.errors", name
    core = set(errors.__all__) - {"GenerationSyncError", "IncompatibleHostError", "LayoutMismatchError"}
    for name in core:
        assert getattr(zerofast, name) is getattr(errors, name) and name in zerofast.__all__, name
    from zerofast.integrations.hf_generation import GenerationSyncError
    from zerofast.integrations.hosts import IncompatibleHostError
    from zerofast.offload import OffloadError

    assert (GenerationSyncError, IncompatibleHostError, OffloadError) == (
        errors.GenerationSyncError,
        errors.IncompatibleHostError,
        errors.OffloadError,
    )


def test_estimator_command_line_rejects_what_zero_adam_rejects(capsys):
    """--bucket-mb with --stage 3 alone is ZeroAdam's error (stage 3's buckets are its units); in the
    table of every stage it sets stages 1 and 2's; --bucket-buffers 0 (no bound) is accepted."""
    with pytest.raises(SystemExit) as exit_info:
        estimate_main(["--params", "1B", "--world", "8", "--stage", "3", "--bucket-mb", "8"])
    assert exit_info.value.code == 2 and "bucket_mb sets stages 1 and 2's buckets" in capsys.readouterr().err
    assert estimate_main(["--params", "1B", "--world", "8", "--bucket-mb", "8", "--bucket-buffers", "0"]) == 0
    assert "stage 3" in capsys.readouterr().out
