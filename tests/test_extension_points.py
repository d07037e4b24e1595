"""The core's extension points, as an integration uses them (zerofast/topology.py's Replication and
ReplicaSource; zerofast/stage3/extensions.py's registries), and what importing zerofast leaves
alone: a replication of our own plugged in as process_group is called at the fixed points of each
step, in order, and its "no" at a commit applies nothing (the result is single-process AdamW over
the committed steps' batches); building a stage-3 optimizer over a Hugging Face model patches
nothing in transformers until its integration is imported; and no library module reaches into the
optimizer through the tests' seam."""

from __future__ import annotations

import pathlib

import torch
from harness import run_ranks
from tolerances import HYPER, fp32_tol, max_abs_diff
from training import global_batch, rank_batch

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS, REFUSED = 3, 1  # the replication says no at step 1's commit


class _Refusing:
    """A ReplicaSource and Replication of fixed membership (one replica: the ranks given) that
    records every call and refuses the commit of step REFUSED."""

    changes_membership = False

    def __init__(self, group):
        self.group, self.calls, self._commits = group, [], 0

    def topology(self, group, plan):
        import torch.distributed as dist

        from zerofast.topology import Topology

        rank, k = dist.get_rank(group), dist.get_world_size(group)
        return Topology(group, rank, k, group, rank, k, None, 1, replication=self)

    def attach(self, opt) -> None:
        self.calls.append("attach")
        self.view = opt.checkpoint_view

    def begin_step(self) -> None:
        self.calls.append("begin")

    def check_step(self, step: int) -> None:
        self.calls.append(f"check {step}")

    def participants_now(self) -> int:
        return 1

    def agree(self, flags) -> None:  # fixed membership: the replicate group's own agreement
        self.calls.append("agree")

    def commit(self) -> bool:
        self._commits += 1
        yes = self._commits - 1 != REFUSED
        self.calls.append(f"commit {yes}")
        return yes

    def on_error(self, error) -> None:
        self.calls.append("error")


def _plugged_in(rank, world, stage):
    import torch.distributed as dist

    from zerofast import ZeroAdam
    from zerofast.tools.models import make_gpt

    model = make_gpt("tiny")
    source = _Refusing(dist.group.WORLD)
    opt = ZeroAdam(model, stage=stage, process_group=source, **HYPER)
    skipped = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = rank_batch(model, step, rank)
        model(x, y)[1].backward()
        opt.step()
        skipped.append(opt.step_was_skipped)
    return {
        "calls": source.calls,
        "skipped": skipped,
        "steps_taken": opt.checkpoint_view.steps_taken(),
        "params": {n: t.clone() for n, t in opt.full_state_dict().items()},
    }


def _committed_only(world: int) -> dict[str, torch.Tensor]:
    """torch.optim.AdamW on one process over the global batches of the committed steps only."""
    from zerofast.tools.models import make_gpt

    model = make_gpt("tiny")
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    for step in range(STEPS):
        if step == REFUSED:
            continue
        _, loss = model(*global_batch(model, step, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_replication_of_our_own_is_called_in_order_and_its_no_applies_nothing():
    expected = _committed_only(2)
    # step() checks with zerofast's count of steps, which a step not committed does not advance.
    counted = [min(s, REFUSED) if s <= REFUSED else s - 1 for s in range(STEPS)]
    per_step = [["begin", f"check {counted[s]}", f"commit {s != REFUSED}"] for s in range(STEPS)]
    for stage in (2, 3):
        for r in run_ranks(_plugged_in, 2, (stage,)):
            assert r["calls"] == ["attach"] + [c for step in per_step for c in step], r["calls"]
            assert r["skipped"] == [s == REFUSED for s in range(STEPS)]
            assert r["steps_taken"] == STEPS - 1  # the step not committed is not counted
            got = {n: r["params"][n] for n in expected}
            # The same reduction order as single-process AdamW's tests: fp32 ulps per step.
            assert max_abs_diff(got, expected) <= fp32_tol(STEPS), (stage, max_abs_diff(got, expected))


def _patches_nothing(rank, world):
    import sys

    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.generation.utils import GenerationMixin

    from zerofast import ZeroAdam

    before = GenerationMixin.__dict__["_extract_generation_mode_kwargs"]
    loaded_before = sorted(m for m in sys.modules if m.startswith("zerofast.integrations"))
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    opt = ZeroAdam(model, stage=3, lr=1e-3)
    untouched = GenerationMixin.__dict__["_extract_generation_mode_kwargs"] is before
    loaded = sorted(m for m in sys.modules if m.startswith("zerofast.integrations"))
    import zerofast.integrations.hf_generation  # noqa: F401

    patched = GenerationMixin.__dict__["_extract_generation_mode_kwargs"] is not before
    opt.remove_hooks()
    return loaded_before, untouched, loaded, patched


def test_importing_zerofast_patches_nothing_until_the_integration_is_imported():
    # A fresh process (forked from the harness's server, which imported torch, transformers and
    # zerofast, never an integration): a stage-3 optimizer over a transformers model leaves
    # transformers as it was and imports no integration; importing the integration patches it.
    [(loaded_before, untouched, loaded, patched)] = run_ranks(_patches_nothing, 1, fresh=True)
    assert loaded_before == [] and untouched and loaded == [] and patched


class _Hosted(torch.nn.Module):
    """A model of a library of our own making, with a generate() a host of ours serves."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(2)))

    def forward(self, x):
        return self.blocks(x)

    def generate(self, x):
        return self.forward(x)


class _Handle:
    detached: list = []

    def __init__(self, module):
        self.module = module

    def detach(self):
        _Handle.detached.append(type(self.module).__name__)


def _our_host(model, tracker):
    """Claims every _Hosted in a model stage 3 shards (and nothing else: the registry is per process)."""
    return [_Handle(m) for m in model.modules() if isinstance(m, _Hosted)]


def _late_host(rank, world):
    from zerofast import UnitPolicy, ZeroAdam
    from zerofast.stage3.extensions import register_model_host

    model = _Hosted()
    opt = ZeroAdam(model, stage=3, units=UnitPolicy(modules=torch.nn.Linear), **HYPER)
    guarded = "generate" in model.__dict__  # no host serves it yet
    register_model_host(_our_host)  # after the model was sharded: attached to it at once
    served = "generate" not in model.__dict__
    _Handle.detached.clear()
    opt.remove_hooks()
    return guarded, served, list(_Handle.detached)


def test_a_model_host_registered_after_sharding_takes_over_from_the_guard():
    for guarded, served, detached in run_ranks(_late_host, 2):
        assert guarded and served and detached == ["_Hosted"]


def test_no_library_module_uses_the_tests_seam():
    """parts_of is the tests' way into the parts behind a front; library code (integrations and
    command lines included) goes through the front, its report() and its checkpoint_view."""
    users = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "zerofast").rglob("*.py")
        if "parts_of" in path.read_text() and path.name not in ("base.py", "zero_adam.py", "builder.py")
    ]
    assert users == []
