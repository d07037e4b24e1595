"""ZeroMuon on real gloo ranks against single-process torch.optim.Muon + torch.optim.AdamW on the
global batch: bitwise on one rank, within a derived tolerance on 2 and 3 (every stage, greedy and
round_robin, awkward shapes, a tied head, a frozen matrix, accumulation, fp16, clipping); Newton-Schulz
once per matrix per step; the same collectives as ZeroAdam; checkpoints resumed bitwise and resharded.
One launch per world size (the cases of a world size run one after another in its ranks)."""

import math
import os
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import run_ranks

import zerofast.checkpoint as ckpt
from zerofast import CommPolicy, LossScalePolicy, MixedPrecisionPolicy, ZeroAdam, ZeroMuon, compat
from zerofast.optim import muon as muon_mod
from zerofast.partition import greedy_by_cost, newton_schulz_flops

STEPS = 4
MUON = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)  # eps: see HYPER in tests/tolerances.py
# fp16 reducing in fp32, as the oracle sums: see [Note: the Muon tolerance]
FP16 = MixedPrecisionPolicy(torch.float16, torch.float32, LossScalePolicy(init_scale=1024.0, growth_interval=1000))
VOCAB, WIDTH, BATCH, SEQ = 32, 8, 2, 8


class Awkward(nn.Module):
    """Every shape Muon's owners must handle: a tied embedding / head (AdamW), a tall (24 x 8) and a
    wide (8 x 24) matrix, a 1 x 8 matrix, three equal 8 x 8 matrices, a frozen 8 x 8 matrix, biases
    and a layer norm (AdamW)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, 3 * WIDTH)  # weight 24 x 8: tall
        self.down = nn.Linear(3 * WIDTH, WIDTH)  # weight 8 x 24: wide
        self.same = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3))
        self.frozen = nn.Linear(WIDTH, WIDTH, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.gate = nn.Linear(WIDTH, 1)  # weight 1 x 8
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied: stays AdamW

    def forward(self, idx, targets):
        x = self.wte(idx)
        x = x + self.down(F.gelu(self.up(x)))
        for layer in self.same:
            x = x + torch.tanh(layer(x))
        x = x + self.frozen(x)
        x = x * torch.sigmoid(self.gate(x))
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(step: int, rank: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def is_muon_default(model, name):
    p = model.get_parameter(name)
    return p.ndim == 2 and p is not model.wte.weight


# --- the oracle -------------------------------------------------------------------------------------


def single_process(
    world: int, steps: int, *, micro: int = 1, fp16: bool = False, max_norm=None, state=None, start: int = 0
):
    """torch.optim.Muon (the 2-D non-embedding matrices) + torch.optim.AdamW (the rest) on one process
    over every rank's micro-batches, as a data-parallel user writes it: an fp32 master of each
    parameter; each (rank, micro-batch) backward separately (in the model's dtype), the gradients
    summed in fp32 in rank order, divided by world; fp16: the loss scaled by 1024 and the gradients
    unscaled; clip_grad_norm_ over all master gradients. state: (model state dict, muon sd, adamw sd)
    to start from (to_torch's), with `start` the first step. Returns the master parameters by name."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank runs: the same matmul blocking
    try:
        model = Awkward()
        if state is not None:
            model.load_state_dict(state[0])
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        master = {n: nn.Parameter(p.detach().clone()) for n, p in named}
        muon_names = [n for n, _ in named if is_muon_default(model, n)]
        muon = torch.optim.Muon([master[n] for n in muon_names], **MUON)
        adamw = torch.optim.AdamW([master[n] for n, _ in named if n not in muon_names], foreach=False, **ADAMW)
        if state is not None:
            muon.load_state_dict(state[1])
            adamw.load_state_dict(state[2])
        if fp16:
            model.half()
        params = [p for _, p in named]
        for step in range(start, start + steps):
            total = None
            for r in range(world):
                for m in range(micro):
                    loss = model(*batch(step, r, m)) * (1024.0 if fp16 else 1.0)
                    grads = [g.float() for g in torch.autograd.grad(loss, params)]
                    total = grads if total is None else [t + g for t, g in zip(total, grads)]
            for (n, _), t in zip(named, total):
                master[n].grad = t / world / (1024.0 if fp16 else 1.0)
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(list(master.values()), max_norm)
            muon.step()
            adamw.step()
            with torch.no_grad():
                for n, p in named:
                    p.copy_(master[n])
        return {n: m.detach().clone() for n, m in master.items()}
    finally:
        torch.set_num_threads(threads)


# --- the ranks' side ---------------------------------------------------------------------------------


def make(stage, partition="greedy", *, fp16=False, max_norm=None, engine=ZeroMuon, shard_size=None, **kw):
    model = Awkward()
    comm = CommPolicy(partition=partition, bucket_mb=0.0005 if stage < 3 else None, shard_size=shard_size)
    if engine is ZeroAdam:
        opt = ZeroAdam(model, stage=stage, comm=comm, max_grad_norm=max_norm, **ADAMW)
    else:
        opt = ZeroMuon(
            model,
            stage=stage,
            comm=comm,
            max_grad_norm=max_norm,
            mixed_precision=FP16 if fp16 else None,
            adamw_lr=ADAMW["lr"],
            adamw_betas=ADAMW["betas"],
            adamw_eps=ADAMW["eps"],
            adamw_weight_decay=ADAMW["weight_decay"],
            **MUON,
            **kw,
        )
    return model, opt


def train(model, opt, rank, steps, *, start=0, micro=1):
    for step in range(start, start + steps):
        for m in range(micro):
            if m < micro - 1:
                with opt.no_sync():
                    opt.backward(model(*batch(step, rank, m)))
            else:
                opt.backward(model(*batch(step, rank, m)))
        opt.step()
        opt.zero_grad()


def master(opt):
    """This rank's fp32 master pieces (every rank's together: the whole model)."""
    return opt.checkpoint_view.trainable.state_pieces("master")


def run_case(rank, stage, partition, **kw):
    micro = kw.pop("micro", 1)
    model, opt = make(stage, partition, **kw)
    before = muon_mod.newton_schulz_calls()
    train(model, opt, rank, STEPS, micro=micro)
    out = {
        "master": master(opt),
        "ns_calls": muon_mod.newton_schulz_calls() - before,
        "comm": opt.report().comm,
        "report": opt.report().partition,
    }
    opt.remove_hooks()
    return out


def comm_of(rank, stage, partition, engine, **kw):
    model, opt = make(stage, partition, engine=engine, **kw)
    train(model, opt, rank, 2)
    stats = opt.report().comm
    opt.remove_hooks()
    return stats


class Term(nn.Module):
    """One parameter whose loss term is (weight * G).sum(): its gradient is exactly G."""

    def __init__(self, shape, weight=None):
        super().__init__()
        self.weight = weight if weight is not None else nn.Parameter(torch.randn(shape) * 0.1)

    def forward(self, grad):
        return (self.weight * grad).sum()


class EmbeddingTerm(nn.Embedding):
    def forward(self, grad):
        return (self.weight * grad).sum()


class Probe(nn.Module):
    """Identical gradients on both sides: the loss is linear in every parameter, with a fixed G per
    (step, parameter), so its gradient is G whatever the parameters are. Awkward's shapes: tall, wide,
    1 x n, three equal; an embedding and a head tied to it (AdamW, gradient G1 + G2), a bias, a frozen matrix."""

    SHAPES = {
        "tall": (24, 8),
        "wide": (8, 24),
        "row": (1, 8),
        "sq0": (8, 8),
        "sq1": (8, 8),
        "sq2": (8, 8),
        "bias": (24,),
        "frozen": (8, 8),
    }

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.emb = EmbeddingTerm(VOCAB, WIDTH)
        self.terms = nn.ModuleList(Term(s) for s in self.SHAPES.values())
        self.terms[-1].weight.requires_grad_(False)
        self.head = Term(None, self.emb.weight)

    def forward(self, step):
        g = torch.Generator().manual_seed(step)
        total = self.emb(torch.randn(VOCAB, WIDTH, generator=g))
        for term in self.terms:
            total = total + term(torch.randn(term.weight.shape, generator=g))
        return total + self.head(torch.randn(VOCAB, WIDTH, generator=g))


def probe_oracle(steps):
    model = Probe()
    muon = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim == 2 and p is not model.emb.weight]
    rest = [p for p in model.parameters() if p.requires_grad and all(p is not q for q in muon)]
    opts = [torch.optim.Muon(muon, **MUON), torch.optim.AdamW(rest, foreach=False, **ADAMW)]
    for step in range(steps):
        model(step).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, {
        n for n, p in model.named_parameters() if any(p is q for q in muon)
    }


def _world_one(rank, world):
    out = {}
    for stage in (1, 2, 3):
        model = Probe()
        opt = ZeroMuon(
            model,
            stage=stage,
            adamw_lr=ADAMW["lr"],
            adamw_betas=ADAMW["betas"],
            adamw_eps=ADAMW["eps"],
            adamw_weight_decay=ADAMW["weight_decay"],
            **MUON,
        )
        before = muon_mod.newton_schulz_calls()
        for step in range(STEPS):
            opt.backward(model(step))
            opt.step()
            opt.zero_grad()
        out[stage] = {
            "master": opt.checkpoint_view.trainable.state_pieces("master"),
            "ns_calls": muon_mod.newton_schulz_calls() - before,
            "muon": opt.muon_names,
        }
        opt.remove_hooks()
    return out


def _world_many(rank, world, root):
    out = {}
    for stage in (1, 2, 3):
        for partition in ("greedy", "round_robin"):
            out[(stage, partition)] = run_case(rank, stage, partition)
    out["accumulate"] = run_case(rank, 2, "greedy", micro=2)
    out["accumulate3"] = run_case(rank, 3, "round_robin", micro=2)
    out["fp16"] = run_case(rank, 2, "greedy", fp16=True)
    out["clip"] = run_case(rank, 1, "round_robin", max_norm=0.05)
    # The same collectives as ZeroAdam of the same layout: round_robin, and greedy by elements.
    out["comm"] = [
        (comm_of(rank, stage, p, ZeroMuon, **kw), comm_of(rank, stage, p, ZeroAdam))
        for stage in (1, 2, 3)
        for p, kw in (("round_robin", {}), ("greedy", {"balance": "numel"}))
    ]
    if world == 2:
        out["checkpoint"] = _checkpoint_save(rank, root)
    return out


def _checkpoint_save(rank, root):
    """Resume bitwise: 3 steps, save, 2 more, against a new optimizer loading the save for the 2."""
    model, opt = make(2, "round_robin")
    train(model, opt, rank, 3)
    ckpt.save(os.path.join(root, "a"), model, opt)
    train(model, opt, rank, 2, start=3)
    straight = master(opt)
    opt.remove_hooks()
    model, opt = make(3, "greedy")  # another stage and partition: the names carry it
    ckpt.load(os.path.join(root, "a"), model, opt)
    train(model, opt, rank, 2, start=3)
    resumed = master(opt)
    opt.remove_hooks()
    return {"straight": straight, "resumed": resumed}


def _checkpoint_reshard(rank, world, root):
    """Load the 2-rank round_robin save on 3 ranks, greedy stage 3, and save it again at once."""
    model, opt = make(3, "greedy")
    ckpt.load(os.path.join(root, "a"), model, opt)
    ckpt.save(os.path.join(root, "b"), model, opt)
    opt.remove_hooks()


# --- assembling and comparing ------------------------------------------------------------------------


def full(per_rank):
    shapes = {n: tuple(p.shape) for n, p in Awkward().named_parameters() if p.requires_grad}
    out = {n: torch.full((math.prod(s),), float("nan")) for n, s in shapes.items()}
    for pieces in per_rank:
        for name, offset, values in pieces:
            out[name][offset : offset + values.numel()] = values
    return {n: t.view(shapes[n]) for n, t in out.items()}


def muon_count(model=None) -> int:
    model = model or Awkward()
    return sum(1 for n, p in model.named_parameters() if p.requires_grad and is_muon_default(model, n))


# [Note: the Muon tolerance]
# Ranks sum the gradient in another order than one process (gloo's ring, and x(1/N) against /N), so
# the fp32 gradients differ by a few ulps. Newton-Schulz runs in bf16 (as torch's does): its input is
# the momentum rounded to bf16, so an fp32-ulp difference flips an element's rounding now and then,
# and the iteration carries that through its matrix products. Each step moves a matrix by
# adjusted_lr * O with |O| <= ~1.5 (its singular values end in [0.5, 1.5]); the tolerance is one bf16
# unit roundoff (2^-8) of the largest such step per step: lr 0.02, the tall matrix's adjustment
# sqrt(3), 4 steps: 8.1e-4. It is set, not proven: Newton-Schulz is no contraction for input
# differences (on small singular values each iteration multiplies by up to a = 3.4445, a^5 = 485 over
# 5 steps), so one flipped bf16 rounding may in principle move an update element by more. Measured on
# this model: at most 3.9e-5 (3 ranks, clipping), mostly ~1e-9, so the bound has 20x margin, while a
# wrong algorithm (no Nesterov, no lr adjustment, a step per micro-batch) moves by the update itself
# (test_tolerance_catches_wrong_updates). AdamW's parameters are held to the same bound (they see
# gradients shaped by the Muon matrices).
#
# fp16 reduces in fp32 here (FP16). With fp16's default reduce in fp16, the ranks' sums differ from one
# process's by fp16's unit roundoff 2^-11 relative, and the amplification above turns that into up to
# 2^-11 * 485 = 0.24 of the update: measured 0.044 after 4 steps on 2 ranks, 20% of the update. That is
# Muon's sensitivity to its input, not an error of the sharding; docs/muon.md recommends
# reduce_dtype=torch.float32 with fp16 for that reason.
def muon_tol(steps: int) -> float:
    update = MUON["lr"] * math.sqrt(3) * 1.5  # the largest step of any matrix: the tall one's
    return steps * update * 2.0**-8


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# --- the tests ---------------------------------------------------------------------------------------


def test_one_rank_fed_identical_gradients_is_torch_muon_and_adamw():
    """Muon's matrices bitwise torch.optim.Muon; the rest within ZeroAdam's fused AdamW kernel's own
    agreement with torch.optim.AdamW (an ulp in a few percent of elements: tests/test_fused_adam.py),
    at most 16 ulps of the parameter scale per step (fp32_tol in tests/tolerances.py)."""
    results = run_ranks(_world_one, 1, timeout=120)
    oracle, muon_names = probe_oracle(STEPS)
    for stage, out in results[0].items():
        assert set(out["muon"]) == muon_names == {f"terms.{i}.weight" for i in range(6)}
        shapes = {n: tuple(t.shape) for n, t in oracle.items()}
        got = {n: torch.full((math.prod(s),), float("nan")) for n, s in shapes.items()}
        for name, offset, values in out["master"]:
            got[name][offset : offset + values.numel()] = values
        for name in oracle:
            mine = got[name].view(shapes[name])
            if name in muon_names:
                assert torch.equal(mine, oracle[name]), f"stage {stage}: {name}"
            else:
                assert (mine - oracle[name]).abs().max().item() <= STEPS * 16 * 2.0**-23, f"stage {stage}: {name}"
        assert out["ns_calls"] == STEPS * len(muon_names)


@pytest.fixture(scope="module")
def root():
    with tempfile.TemporaryDirectory() as d:
        yield d


@pytest.mark.parametrize("world", [2, 3])
def test_matches_torch_on_many_ranks(world, root):
    results = run_ranks(_world_many, world, args=(root,), timeout=300)
    if world == 3:  # the 2-rank checkpoint, resharded onto 3 ranks (world 2 ran first)
        run_ranks(_checkpoint_reshard, 3, args=(root,), timeout=120)
    oracles = {1: single_process(world, STEPS)}
    cases = [(k, 1) for k in results[0] if isinstance(k, tuple)]
    cases += [
        ("accumulate", dict(micro=2)),
        ("accumulate3", dict(micro=2)),
        ("fp16", dict(fp16=True)),
        ("clip", dict(max_norm=0.05)),
    ]
    for key, how in cases:
        oracle = oracles[1] if how == 1 else single_process(world, STEPS, **how)
        got = full([out[key]["master"] for out in results])
        diff = max_diff(got, oracle)
        tol = muon_tol(STEPS)
        print(f"{key} on {world} ranks: {diff:.3g} (tolerance {tol:.3g})")
        assert diff <= tol, f"{key} on {world} ranks: {diff:.3g} > {tol:.3g}"
        # Newton-Schulz once per matrix per step, across all ranks together
        calls = sum(out[key]["ns_calls"] for out in results)
        assert calls == STEPS * muon_count(), f"{key}: {calls} Newton-Schulz runs"
        # report().partition: each rank's Newton-Schulz FLOPs per step, every matrix counted once
        flops = results[0][key]["report"].ns_flops
        model = Awkward()
        total = sum(
            newton_schulz_flops(tuple(p.shape), 5)
            for n, p in model.named_parameters()
            if p.requires_grad and is_muon_default(model, n)
        )
        assert len(flops) == world and sum(flops) == total, (key, flops, total)
        assert results[0][key]["report"].ns_imbalance == pytest.approx(max(flops) / (total / world)), key
    for pairs in zip(*(out["comm"] for out in results)):
        for muon_stats, adam_stats in pairs:
            assert muon_stats == adam_stats, (muon_stats, adam_stats)
    if world == 2:
        out0 = [out["checkpoint"] for out in results]
        straight, resumed = full([o["straight"] for o in out0]), full([o["resumed"] for o in out0])
        for name in straight:
            assert torch.equal(straight[name], resumed[name]), name
    else:
        _check_reshard(root)


def _check_reshard(root):
    """The 2-rank round_robin save and its 3-rank greedy stage-3 re-save hold the same bits; to_torch's
    state dicts load into torch.optim.Muon / AdamW and continue as the 2-rank run did."""
    model_a, optim_a = ckpt.to_torch(os.path.join(root, "a"))
    model_b, optim_b = ckpt.to_torch(os.path.join(root, "b"))
    assert set(optim_a) == {"muon", "adamw"}
    for key in model_a:
        assert torch.equal(model_a[key], model_b[key]), key
    for kind in ("muon", "adamw"):
        assert optim_a[kind]["param_groups"] == optim_b[kind]["param_groups"]
        for i, s in optim_a[kind]["state"].items():
            for k, v in s.items():
                assert torch.equal(v, optim_b[kind]["state"][i][k]), (kind, i, k)
    assert len(optim_a["muon"]["state"]) == muon_count()
    assert all(set(s) == {"momentum_buffer"} for s in optim_a["muon"]["state"].values())
    continued = single_process(2, 2, state=(model_a, optim_a["muon"], optim_a["adamw"]), start=3)
    straight = single_process(2, 5)
    assert max_diff(continued, straight) <= muon_tol(5)


@pytest.mark.parametrize(
    "shape, fn, nesterov",
    [((24, 8), None, True), ((8, 24), "match_rms_adamw", False), ((1, 8), "original", True)]
    + [((5, 5), "spectral_unclamped", True)],
)
def test_newton_schulz_is_torch_muon(shape, fn, nesterov):
    """The math alone: muon_update_ on random matrices is bitwise torch.optim.Muon, every adjust_lr_fn
    this torch's Muon has (zerofast.compat: "spectral_unclamped" from torch 2.14)."""
    if fn not in compat.torch_muon_adjust_lr_fns():
        pytest.skip(f"torch {torch.__version__}'s Muon has no adjust_lr_fn={fn!r} to compare with (torch 2.14 has)")
    torch.manual_seed(0)
    p = torch.randn(shape)
    ref = nn.Parameter(p.clone())
    opt = torch.optim.Muon([ref], lr=0.02, nesterov=nesterov, adjust_lr_fn=fn)
    mine, buf = p.clone(), torch.zeros(shape)
    for _ in range(3):
        g = torch.randn(shape)
        ref.grad = g.clone()
        opt.step()
        muon_mod.muon_update_(
            mine,
            g,
            buf,
            lr=0.02,
            weight_decay=0.1,
            momentum=0.95,
            nesterov=nesterov,
            ns_coefficients=muon_mod.NS_COEFFICIENTS,
            ns_steps=5,
            eps=1e-7,
            adjust_lr_fn=fn,
        )
    assert torch.equal(mine, ref.detach()), (shape, fn)
    assert torch.equal(buf, opt.state[ref]["momentum_buffer"])


def test_tolerance_catches_wrong_updates():
    """The tolerance is tight enough to see a wrong algorithm: no Nesterov changes the result by far more."""
    oracle = single_process(2, STEPS)
    saved = MUON["nesterov"]
    MUON["nesterov"] = False
    try:
        wrong = single_process(2, STEPS)
    finally:
        MUON["nesterov"] = saved
    assert max_diff(oracle, wrong) > 10 * muon_tol(STEPS)


def test_greedy_balances_newton_schulz_cost():
    """Pure partition logic: equal matrices spread evenly; AdamW tensors go to the rank with fewest elements."""
    shapes = [(1024, 256)] * 8 + [(768, 256)] * 4 + [(256, 256)] * 4
    costs = [newton_schulz_flops(s, 5) for s in shapes] + [0, 0]
    numels = [a * b for a, b in shapes] + [50000, 256]
    owners = greedy_by_cost(numels, costs, 4)
    load = [0] * 4
    for i, r in enumerate(owners):
        load[r] += costs[i]
    assert max(load) / (sum(load) / 4) <= 1.2
    assert newton_schulz_flops((8, 24), 5) == newton_schulz_flops((24, 8), 5) == 5 * (4 * 64 * 24 + 2 * 512)


def _bad_inputs(rank, world):
    errors = {}
    cases = {
        "flat": lambda m: dict(comm=CommPolicy(partition="flat")),
        "not_2d": lambda m: dict(muon_params=[m.up.bias]),
        "not_in_model": lambda m: dict(muon_params=[nn.Parameter(torch.zeros(3, 3))]),
        "name_not_in_model": lambda m: dict(muon_params=["nope.weight"]),
        "adjust": lambda m: dict(adjust_lr_fn="sqrt"),
        "balance": lambda m: dict(balance="flops"),
        # The configuration's own errors name the optimizer being built.
        "stage": lambda m: dict(stage=4),
        "units": lambda m: dict(stage=2, units=[m.up]),
        "adamw_lr": lambda m: dict(adamw_lr=-1.0),
    }
    for key, kw in cases.items():
        model = Awkward()
        try:
            ZeroMuon(model, **kw(model))
            errors[key] = None
        except (ValueError, TypeError) as e:
            errors[key] = str(e)
    # more ranks than matrices is fine; a callable selects by name
    model = Awkward()
    opt = ZeroMuon(model, stage=2, muon_params=lambda n, p: n == "gate.weight")
    errors["callable"] = opt.muon_names
    opt.remove_hooks()
    return errors


def test_bad_input_names_argument_and_value():
    errors = run_ranks(_bad_inputs, 1, timeout=60)[0]
    assert "partition='flat'" in errors["flat"]
    assert "up.bias" in errors["not_2d"] and "(24,)" in errors["not_2d"]
    assert "muon_params" in errors["not_in_model"] and "(3, 3)" in errors["not_in_model"]
    assert "'nope.weight'" in errors["name_not_in_model"]
    assert "adjust_lr_fn" in errors["adjust"] and "'sqrt'" in errors["adjust"]
    assert "balance" in errors["balance"] and "'flops'" in errors["balance"]
    assert errors["callable"] == ["gate.weight"]
    for key in ("stage", "units", "adamw_lr"):
        assert errors[key].startswith("ZeroMuon"), (key, errors[key])


def _hybrid(rank, world):
    return {stage: run_case(rank, stage, "greedy", shard_size=2) for stage in (2, 3)}


def test_hybrid_sharding_runs_newton_schulz_once_per_matrix_in_each_replica():
    """4 ranks as 2 shard groups of 2 (CommPolicy(shard_size=2)): each group owns every matrix once, so
    Newton-Schulz runs once per matrix per step in each replica, on the averaged gradient of all 4."""
    results = run_ranks(_hybrid, 4, timeout=300)
    oracle = single_process(4, STEPS)
    for stage in (2, 3):
        for replica in ((0, 1), (2, 3)):
            got = full([results[r][stage]["master"] for r in replica])
            diff = max_diff(got, oracle)
            assert diff <= muon_tol(STEPS), f"stage {stage}, ranks {replica}: {diff:.3g}"
            calls = sum(results[r][stage]["ns_calls"] for r in replica)
            assert calls == STEPS * muon_count(), (stage, replica, calls)
        assert "replicate/all_reduce" in results[0][stage]["comm"]
