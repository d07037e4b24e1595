"""Frozen parameters in stage 3: sharded and gathered with their unit, never given a gradient or
optimizer state ([Note: frozen parameters in stage 3] in zerofast/stage3/frozen.py). A mostly
frozen model holds about (all parameters)/N per rank and trains as single-process AdamW; tied
frozen weights, modules mixing frozen and trainable parameters, units of one kind only,
checkpoints across stages, gradient checkpointing, and the estimator's count."""

import math
import os
import shutil
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import run_ranks
from oracles import single_process
from probes import layout_of, param_bytes
from tolerances import HYPER, fp32_tol, max_abs_diff
from training import train_steps, zero_options

from zerofast import ZeroAdam
from zerofast import checkpoint as ck
from zerofast.layout import ALIGN
from zerofast.optim.zero_adam import parts_of
from zerofast.tools.models import make_gpt

STEPS = 3
DEEP = 4  # blocks of the mostly frozen GPT: more than the two a rank may hold gathered at once
TOL = fp32_tol(STEPS)  # see the tolerances in tests/tolerances.py


class LoRA(nn.Module):
    """A frozen Linear plus a trainable rank-1 update (both factors random, so both get gradients)."""

    def __init__(self, base: nn.Linear, rank: int = 1):
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.down.weight, std=0.02)
        nn.init.normal_(self.up.weight, std=0.02)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def lora_gpt(keep_wpe: bool = False, checkpointing=None, n_layer: int = 2):
    """The tiny GPT, every parameter frozen (the tied embedding too), LoRA on each block's fc. With
    keep_wpe the position embedding trains too (so the blocks' inputs need a gradient, as reentrant
    checkpointing wants); checkpointing: None, or use_reentrant for torch.utils.checkpoint around
    each block."""
    model = make_gpt("tiny", n_layer=n_layer)
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(5)
    for block in model.blocks:
        block.fc = LoRA(block.fc)
    if keep_wpe:
        model.wpe.weight.requires_grad_(True)
    if checkpointing is not None:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = Checkpointed(block, checkpointing)
    return model


class Checkpointed(nn.Module):
    def __init__(self, block: nn.Module, use_reentrant: bool):
        super().__init__()
        self.block, self.use_reentrant = block, use_reentrant

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.use_reentrant)


class MixedBlock(nn.Module):
    """A Linear whose weight is frozen and whose bias trains, then a trainable LayerNorm."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.lin.weight.requires_grad_(False)
        nn.init.normal_(self.lin.bias, std=0.02)
        self.ln = nn.LayerNorm(width)

    def forward(self, h):
        return self.ln(h + F.gelu(self.lin(h)))


class Mixed(nn.Module):
    """A frozen embedding tied to the output head (used at both ends), mixed blocks, a frozen-only
    block whose input needs a gradient, and a trainable-only adapter: with units=Mixed.units(m) the
    root's unit is frozen only, the adapter's trainable only, the blocks' both."""

    def __init__(self, vocab: int = 37, width: int = 24):
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(vocab, width)
        self.emb.weight.requires_grad_(False)
        self.first, self.last = MixedBlock(width), MixedBlock(width)
        self.frozen_block = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.frozen_block.requires_grad_(False)
        self.adapter = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied, frozen
        self.cfg = type("Cfg", (), {"vocab_size": vocab, "block_size": 8})()

    @staticmethod
    def units(m):
        return [m.first, m.frozen_block, m.adapter, m.last]

    def forward(self, x, y):
        h = self.first(self.emb(x))
        h = self.frozen_block(h)
        h = h + self.adapter(h)
        h = self.last(h)
        return None, F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _full(opt, model) -> dict[str, torch.Tensor]:
    """Every key of model.state_dict(), whole (stage 3: gathered)."""
    with opt.gathered_params():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _params(opt, model) -> dict[str, torch.Tensor]:
    with opt.gathered_params():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


# --- a mostly frozen model: memory per rank, and exactness -------------------------------------------


def _mostly_frozen(rank, world):
    out = {}
    for partition in ("flat", "greedy"):
        model = lora_gpt(n_layer=DEEP)
        opt = ZeroAdam(model, **zero_options(3, partition=partition, min_unit_mb=0), **HYPER)
        samples = []

        def sample(*_):
            samples.append(param_bytes(opt))

        for block in model.blocks:  # inside every block's forward and backward, at both ends
            block.register_forward_pre_hook(sample)
            block.register_forward_hook(sample)
            block.register_full_backward_pre_hook(sample)
            block.register_full_backward_hook(sample)
        train_steps(model, opt, rank, STEPS)
        # Each unit gathered at its padded size, trainable and frozen parts together, counted here
        # from the unit buffers' own parts (the test seam) rather than read off the report.
        unit_parts = parts_of(opt).units.buffers.parts
        report = opt.report()
        unit_bytes = [
            sum(p.layout.buckets[p.bucket_of[u]].numel * 4 for p in unit_parts if p.bucket_of[u] is not None)
            for u in range(len(report.units))
        ]
        view = opt.checkpoint_view
        r = dict(
            after=report.memory.materialized_params,
            report=report.units,
            peak=max(samples),
            samples=len(samples),
            root=unit_bytes[0],
            unit_bytes=unit_bytes,
            blocks=sorted(unit_bytes[1:], reverse=True),
            memory=report.memory,
            comm=report.comm,
            buckets=len(view.trainable.layout.buckets) + len(view.frozen.layout.buckets),
            grad_numel=view.trainable.layout.shard_numel(rank),
            frozen_numel=view.frozen.layout.shard_numel(rank),
            frozen_grads=[n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None],
        )
        r["params"] = _params(opt, model)
        r["after_gathered"] = param_bytes(opt)
        out[partition] = r
    model = lora_gpt(n_layer=DEEP)
    opt = ZeroAdam(model, stage=2, **HYPER)
    train_steps(model, opt, rank, STEPS)
    out["stage 2"] = _params(opt, model)
    return out


def test_mostly_frozen_model_holds_a_shard_and_trains_exactly():
    model = lora_gpt(n_layer=DEEP)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable < 0.05 * total
    expected = single_process(lambda: lora_gpt(n_layer=DEEP), 2, STEPS)
    for rank, out in enumerate(run_ranks(_mostly_frozen, 2)):
        for partition in ("flat", "greedy"):
            r = out[partition]
            where = f"{partition} rank {rank}"
            d = max_abs_diff(r["params"], expected)
            assert d <= TOL, f"{where}: {d:.3g} from single-process AdamW"
            assert not r["frozen_grads"], f"{where}: frozen parameters got a .grad: {r['frozen_grads']}"
            # (all parameters) / N, up to each bucket's padding (flat) or the greedy imbalance.
            bound = math.ceil(total / 2) * 4 + r["buckets"] * 2 * ALIGN * 4
            if partition == "greedy":
                bound = max(bound, (r["grad_numel"] + r["frozen_numel"]) * 4)
            print(
                f"{where}: {r['after']} bytes of parameters per rank after step(); whole model {total * 4}, "
                f"all/N {math.ceil(total / 2) * 4}"
            )
            assert r["after"] == (r["grad_numel"] + r["frozen_numel"]) * 4
            assert r["after"] <= bound and r["after"] < 0.6 * total * 4, (r["after"], bound, total * 4)
            assert r["after_gathered"] == r["after"], "gathered_params() must release the frozen parts too"
            # Inside a block: the shard, the root's unit and at most two blocks' units (the current one
            # and the prefetched one), frozen parts included; nothing else stays gathered.
            assert r["samples"] >= 2 * STEPS
            assert r["after"] < r["peak"] <= r["after"] + r["root"] + sum(r["blocks"][:2]), (r["peak"], r["after"])
            # No gradient or optimizer bytes for the frozen parameters: only the trainable shard's.
            assert r["memory"].grad_shard == r["grad_numel"] * 4
            assert r["memory"].optimizer == r["grad_numel"] * 8
            assert r["memory"].params + r["memory"].frozen_params == r["after"]
            assert [u.gathered_bytes for u in r["report"]] == r["unit_bytes"], where  # the report's, as counted
            root = r["report"][0]
            assert (
                root.module == "" and root.frozen_tensors == root.tensors == 4
            )  # wte (tied), wpe, ln_f.weight, ln_f.bias
        assert max_abs_diff(out["stage 2"], expected) <= TOL


# --- tied frozen weights, mixed modules, units of one kind ------------------------------------------


def _mixed(rank, world):
    out = {}
    for partition in ("flat", "round_robin"):
        model = Mixed()
        opt = ZeroAdam(
            model,
            **zero_options(
                3, partition=partition, units=Mixed.units(model), check_collectives=partition == "round_robin"
            ),
            **HYPER,
        )
        train_steps(model, opt, rank, STEPS)
        out[partition] = dict(
            params=_params(opt, model),
            report=opt.report().units,
            buckets=[parts_of(opt).units.buffers.bucket(u) for u in range(len(opt.report().units))],
            tied=model.head.weight is model.emb.weight,
        )
    model = Mixed()
    opt = ZeroAdam(model, **zero_options(3, mixed_precision="bf16", units=Mixed.units(model)), **HYPER)
    train_steps(model, opt, rank, STEPS)
    out["bf16"] = {k: v.float() for k, v in _params(opt, model).items()}
    model = Mixed()
    opt = ZeroAdam(model, **zero_options(2, mixed_precision="bf16"), **HYPER)
    train_steps(model, opt, rank, STEPS)
    out["bf16 stage 2"] = {k: v.float() for k, v in _params(opt, model).items()}
    out["stage 2 shards no frozen"] = opt.checkpoint_view.frozen is None and parts_of(opt).frozen is None
    return out


def test_tied_frozen_embedding_mixed_modules_and_one_kind_units():
    expected = single_process(Mixed, 2, STEPS)
    for rank, out in enumerate(run_ranks(_mixed, 2)):
        for partition in ("flat", "round_robin"):
            r = out[partition]
            d = max_abs_diff(r["params"], expected)
            assert d <= TOL, f"{partition} rank {rank}: {d:.3g} from single-process AdamW"
            assert r["tied"]
            kinds = {u.module: (u.tensors - u.frozen_tensors, u.frozen_tensors) for u in r["report"]}
            assert kinds == {"": (0, 1), "first": (3, 1), "frozen_block": (0, 2), "adapter": (2, 0), "last": (3, 1)}
            # Frozen-only units have no trainable bucket.
            assert [b is None for b in r["buckets"]] == [True, False, True, False, False]
        # bf16: the frozen parameters converted and sharded too; the same training as stage 2's.
        assert max_abs_diff(out["bf16"], out["bf16 stage 2"]) == 0.0
        assert out["stage 2 shards no frozen"]


# --- checkpoints: frozen parameters saved from their shards, loaded into another stage ---------------


def _save_and_load(rank, world, path):
    model = Mixed()
    opt = ZeroAdam(model, **zero_options(3, units=Mixed.units(model)), **HYPER)
    train_steps(model, opt, rank, STEPS)
    saved = _full(opt, model)
    ck.save(path, model, opt)
    out = {"saved": saved}
    for name, options in (("stage 3", zero_options(3, partition="greedy", min_unit_mb=0)), ("stage 2", dict(stage=2))):
        other = Mixed()
        with torch.no_grad():
            for p in other.parameters():
                p.fill_(7.0)
        other_opt = ZeroAdam(other, **options, **HYPER)
        ck.load(path, other, other_opt)
        out[name] = _full(other_opt, other)
        train_steps(other, other_opt, rank, 1, start=STEPS)  # and it trains on
        out[name + " trained"] = _params(other_opt, other)
    other = Mixed()  # plain torch into stage 3: each rank keeps its pieces of the frozen parameters too
    other_opt = ZeroAdam(other, **zero_options(3, units=Mixed.units(other)), **HYPER)
    ck.from_torch(saved, None, other, other_opt)
    out["from_torch"] = _full(other_opt, other)
    return out


def test_checkpoint_keeps_every_key_and_reshards_frozen():
    root = tempfile.mkdtemp(prefix="zerofast-frozen-")
    try:
        path = os.path.join(root, "step-3")
        results = run_ranks(_save_and_load, 2, args=(path,))
        keys = set(Mixed().state_dict())
        for rank, out in enumerate(results):
            assert set(out["saved"]) == keys
            for name in ("stage 3", "stage 2", "from_torch"):
                assert set(out[name]) == keys, name
                bad = [k for k in keys if not torch.equal(out[name][k], out["saved"][k])]
                assert not bad, f"rank {rank}, {name}: {bad} differ from what was saved"
            assert max_abs_diff(out["stage 3 trained"], out["stage 2 trained"]) <= fp32_tol(1)
        # A plain model loads the model entry with DCP alone, frozen chunks included.
        import torch.distributed.checkpoint as dcp

        plain = Mixed()
        sd = {"model": plain.state_dict()}
        dcp.load(sd, checkpoint_id=path, no_dist=True)
        assert all(torch.equal(sd["model"][k], results[0]["saved"][k]) for k in keys)
        # Saved from the shards: each frozen parameter as the ranks' chunks, not whole.
        meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        assert len(meta["model.emb.weight"].chunks) >= 2 and len(meta["model.frozen_block.0.weight"].chunks) >= 2
        model_sd, _ = ck.to_torch(path)
        assert model_sd.keys() == keys and all(torch.equal(model_sd[k], results[0]["saved"][k]) for k in keys)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --- gradient checkpointing with frozen parameters --------------------------------------------------


def _checkpointing(rank, world):
    out = {}
    for reentrant in (True, False):
        model = lora_gpt(keep_wpe=True, checkpointing=reentrant)
        opt = ZeroAdam(model, **zero_options(3, min_unit_mb=0), **HYPER)
        train_steps(model, opt, rank, STEPS)
        out[reentrant] = dict(
            params=_params(opt, model),
            after=param_bytes(opt),
            shard=(layout_of(opt).shard_numel(rank) + opt.checkpoint_view.frozen.layout.shard_numel(rank)) * 4,
        )
    return out


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_gradient_checkpointing_with_frozen_parameters():
    expected = {
        r: single_process(lambda r=r: lora_gpt(keep_wpe=True, checkpointing=r), 2, STEPS) for r in (True, False)
    }
    for rank, out in enumerate(run_ranks(_checkpointing, 2)):
        for reentrant in (True, False):
            r = out[reentrant]
            d = max_abs_diff(r["params"], expected[reentrant])
            assert d <= TOL, f"use_reentrant={reentrant} rank {rank}: {d:.3g} from single-process AdamW"
            assert r["after"] == r["shard"]


# --- the estimator ----------------------------------------------------------------------------------


def test_estimator_counts_frozen_parameters_apart():
    from zerofast.estimate import estimate_memory

    model = lora_gpt()
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = total - trainable
    for stage in (0, 1, 2, 3):
        got = estimate_memory(model, 4, stage)
        alone = estimate_memory(trainable, 4, stage)  # the count form: trainable parameters only
        assert got.grads == alone.grads and got.optimizer == alone.optimizer
        assert got.zerofast_extra == alone.zerofast_extra
        frozen_bytes = 4 * (math.ceil(frozen / 4) if stage == 3 else frozen)
        assert got.params == alone.params + frozen_bytes, stage
    bf16 = estimate_memory(model, 4, 3, mixed_precision="bf16")
    assert bf16.params == 2 * (math.ceil(trainable / 4) + math.ceil(frozen / 4))
