"""ZeroMuon with 8-bit state (MixedPrecisionPolicy(state_bits=8): [Note: Muon's 8-bit momentum]) on
real gloo ranks. The model is models.Nested (blocks three levels down, a tied embedding / head,
biases and layer norms): Muon on its six hidden matrices (20 x 10 and 10 x 20: 6.25 blocks of 32
each, so every matrix ends inside a block), 8-bit AdamW on the rest.

The oracle, in one process: torch.optim.Muon on the matrices with each momentum_buffer passed
through zerofast.quant's quantize -> dequantize after every step, and zerofast.reference_quant's
ReferenceAdam8 (the fused 8-bit kernel's math, bitwise) on the rest. With the same batch on every
rank, the averaged gradient is exact at 1, 2 and 4 ranks (a sum of 2^k equal values times 2^-k), so
ZeroMuon is bitwise the oracle at each of them, in every stage and both owner partitions, with bf16
parameters (stages 2 and 3) and hybrid sharding (4 ranks as 2 x 2): the parameters, the momentum's
bytes and scales (quantize() of the oracle's momentum before its rounding) and the AdamW moments'
bytes and scales; ZeroMuon's optimizer bytes are ZeroAdam's (what the estimator counts). Checkpoints: saved at 2 ranks (blocking and
asynchronously), loaded at 1 and 4 ranks in another stage and partition, stored bytes as saved and
training continuing bitwise as the uninterrupted run; an fp32-state ZeroMuon checkpoint into an
8-bit run (quantized) and back (dequantized); to_torch dequantizes the momentum, from_torch
quantizes it. Cost: about 25 s on 2 cores (three launches: 2, 1 and 4 ranks; 3 steps of a
3-layer width-10 model per configuration)."""

import os
import shutil
import tempfile

import pytest
import torch
from harness import run_ranks
from models import Nested, model_loss
from tolerances import HYPER
from training import rank_batch, train_same_batch

from zerofast import CommPolicy, MixedPrecisionPolicy, ZeroAdam, ZeroMuon
from zerofast import checkpoint as ck
from zerofast.quant import code_of, dequantize, num_blocks, quantize, scale_kind
from zerofast.reference_quant import ReferenceAdam8

STEPS = 3
BLOCK = 32  # small: every matrix spans several blocks and ends inside one
MUON = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
# (stage, partition, parameters' dtype, shard_size): every stage and owner partition in fp32, bf16
# parameters (an fp32 master) in stages 2 and 3; hybrid sharding at 4 ranks (HYBRID)
CONFIGS = [(stage, partition, "fp32", None) for stage in (1, 2, 3) for partition in ("greedy", "round_robin")]
CONFIGS += [(2, "round_robin", "bf16", None), (3, "greedy", "bf16", None)]
HYBRID = [(2, "greedy", "fp32", 2), (3, "round_robin", "bf16", 2)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MOMENTUM = "momentum_buffer"


def _model():
    return Nested(width=10)


def _is_muon(model, name) -> bool:
    p = model.get_parameter(name)
    return p.ndim == 2 and p is not model.backbone.embed.weight


def _make(stage, partition, bits=8, perturb=False, dtype="fp32", shard_size=None, block=BLOCK):
    model = _model()
    if perturb:  # other initial values: everything must come from the checkpoint
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5).add_(0.25)
    opt = ZeroMuon(
        model,
        stage=stage,
        # several buckets in stages 1 and 2
        comm=CommPolicy(partition=partition, bucket_mb=0.0005 if stage < 3 else None, shard_size=shard_size),
        mixed_precision=MixedPrecisionPolicy(DTYPES[dtype], state_bits=bits, state_block=block),
        adamw_lr=HYPER["lr"],
        adamw_betas=HYPER["betas"],
        adamw_eps=HYPER["eps"],
        adamw_weight_decay=HYPER["weight_decay"],
        **MUON,
    )
    return model, opt


def _train(model, opt, start=0, steps=STEPS):
    train_same_batch(model, opt, start, steps)


def _snapshot(model, opt) -> dict:
    """The full parameters, the step counts, and this rank's pieces of every stored state: the
    master, and with 8-bit state each kind's bytes and scales as stored (ShardedPart.saved_kinds), with fp32 state
    each kind's values."""
    part = opt.checkpoint_view.trainable
    with opt.gathered_params():
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    kinds = part.saved_kinds
    pieces = [
        (
            part.params[pc.param][0],
            pc.param_offset,
            {k: part.piece_view(pc, k).clone() for k in ("master", *kinds(pc.param))},
        )
        for pc in part.pieces
    ]
    return {"params": params, "steps": opt.checkpoint_view.step_counts(), "pieces": pieces, "block": part.state_block}


def _placed(snapshots) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank's pieces placed into whole per-parameter tensors (flat; a scale kind per block);
    every element and block must be written by exactly one rank (NaN / -1 where none was)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for snap in snapshots:
        for name, offset, values in snap["pieces"]:
            numel = snap["params"][name].numel()
            for kind, v in values.items():
                scale = kind.endswith("_scale")
                block = snap["block"]
                size, at = (num_blocks(numel, block), offset // block) if scale else (numel, offset)
                whole = out.setdefault(name, {}).setdefault(
                    kind,
                    torch.full((size,), -1, dtype=torch.int64)
                    if v.dtype == torch.uint8
                    else torch.full((size,), float("nan")),
                )
                region = whole[at : at + v.numel()]
                assert (region == -1).all() if v.dtype == torch.uint8 else region.isnan().all(), (name, kind)
                region.copy_(v.to(whole.dtype))
    for name, kinds in out.items():
        for kind, whole in kinds.items():
            assert not ((whole == -1).any() or whole.isnan().any()), f"{name} {kind}: not every element stored"
    return out


# --- the ranks' side --------------------------------------------------------------------------------


def _save(root):
    """2 ranks: an 8-bit run of stage 2 round_robin saved after STEPS steps (blocking and
    asynchronously) then STEPS more; an fp32-state run saved after STEPS steps."""
    model, opt = _make(2, "round_robin")
    _train(model, opt)
    ck.save(os.path.join(root, "q8"), model, opt)
    ck.save(os.path.join(root, "q8-async"), model, opt, blocking=False).wait()
    saved = _snapshot(model, opt)
    _train(model, opt, STEPS)
    uninterrupted = _snapshot(model, opt)
    opt.remove_hooks()
    model, opt = _make(2, "round_robin", bits=32)
    _train(model, opt)
    ck.save(os.path.join(root, "fp32"), model, opt)
    saved32 = _snapshot(model, opt)
    opt.remove_hooks()
    return {"saved": saved, "uninterrupted": uninterrupted, "saved32": saved32}


def _load(root, stage, partition):
    out = {}
    for name, source, bits, block in (
        ("q8", "q8", 8, BLOCK),
        ("q8_async", "q8-async", 8, BLOCK),
        ("q8_into_fp32", "q8", 32, BLOCK),
        ("fp32_into_q8", "fp32", 8, BLOCK),
        ("q8_into_block64", "q8", 8, 64),  # another block size: dequantized, quantized in the run's blocks
    ):
        model, opt = _make(stage, partition, bits, perturb=True, block=block)
        ck.load(os.path.join(root, source), model, opt)
        out[name] = _snapshot(model, opt)
        if name == "q8":
            _train(model, opt, STEPS)
            out["q8_continued"] = _snapshot(model, opt)
        opt.remove_hooks()
    # from_torch: to_torch's state dicts (read here, in full on every rank) into a fresh 8-bit run
    model_sd, optim_sd = ck.to_torch(os.path.join(root, "q8"))
    model, opt = _make(stage, partition, perturb=True)
    ck.from_torch(model_sd, optim_sd, model, opt)
    out["from_torch"] = _snapshot(model, opt)
    opt.remove_hooks()
    return out


def _world(rank, world, root, load):
    out = {}
    for stage, partition, dtype, shard_size in CONFIGS + (HYBRID if world == 4 else []):
        model, opt = _make(stage, partition, dtype=dtype, shard_size=shard_size)
        _train(model, opt)
        out[stage, partition, dtype, shard_size] = _snapshot(model, opt)
        opt.remove_hooks()
    # The estimator's count is ZeroAdam's (zerofast/estimate/memory.py): ZeroMuon holds the same state
    # buffers, a matrix's 8-bit momentum in exp_avg's bytes and scales, under the same layout.
    out["optimizer_bytes"] = []
    for engine, kw in ((ZeroMuon, {}), (ZeroAdam, HYPER)):
        model = _model()
        comm = CommPolicy(partition="round_robin")
        opt = engine(model, 2, comm=comm, mixed_precision=MixedPrecisionPolicy(state_bits=8, state_block=BLOCK), **kw)
        out["optimizer_bytes"].append(opt.report().memory.optimizer)
        opt.remove_hooks()
    if load is None:
        out["checkpoint"] = _save(root)
    else:
        out["checkpoint"] = _load(root, *load)
    return out


# --- the oracle ---------------------------------------------------------------------------------------


def _oracle(steps: int, rounded: bool = True, dtype: str = "fp32"):
    """torch.optim.Muon (its momentum through quantize -> dequantize after every step) and
    ReferenceAdam8 on one process, one thread (as every rank runs: a matmul's blocking may depend on
    the number of threads). Returns each step's (parameters, stored state by name), stored state in
    _placed's form: a Muon matrix's momentum bytes / scales (quantize() of its momentum before the
    rounding) and an AdamW parameter's moments. rounded=False: torch.optim.Muon's fp32 momentum as it
    is. dtype "bf16": the model in bf16, Muon on fp32 masters of its matrices (the model receives their
    rounding, as ZeroMuon's low-precision copy), ReferenceAdam8 keeping its own fp32 master."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _model()
        named = list(model.named_parameters())
        muon_named = [(n, p) for n, p in named if _is_muon(model, n)]
        adam_named = [(n, p) for n, p in named if not _is_muon(model, n)]
        master = {n: torch.nn.Parameter(p.detach().clone()) for n, p in muon_named}
        muon = torch.optim.Muon(list(master.values()), **MUON)
        adam = ReferenceAdam8([p for _, p in adam_named], block=BLOCK, **HYPER)
        model.to(DTYPES[dtype])
        code = code_of(MOMENTUM)
        history = []
        for step in range(steps):
            x, y = rank_batch(model, step, 0)
            model_loss(model, x, y).backward()
            for n, p in muon_named:
                master[n].grad = p.grad.float()
            muon.step()
            adam.step()
            muon.zero_grad()
            adam.zero_grad()
            stored = {}
            with torch.no_grad():
                for n, p in muon_named:
                    p.grad = None
                    p.copy_(master[n])
                    buf = muon.state[master[n]]["momentum_buffer"]
                    q, scales = quantize(buf.reshape(-1), code, BLOCK)
                    if rounded:
                        buf.copy_(dequantize(q, scales, code, BLOCK).view_as(buf))
                    stored[n] = {MOMENTUM: q.long(), scale_kind(MOMENTUM): scales}
            for (n, _), st in zip(adam_named, adam.state):
                stored[n] = {k: st[k].long() if st[k].dtype == torch.uint8 else st[k].clone() for k in _ADAM_STORED}
            history.append(({n: p.detach().float().clone() for n, p in named}, stored))
        return history
    finally:
        torch.set_num_threads(threads)


_ADAM_STORED = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")


def _assert_state_equal(got: dict, want: dict, where: str, kinds=None):
    for n, stored in want.items():
        for k, v in stored.items():
            if kinds is None or k in kinds:
                assert torch.equal(got[n][k], v), f"{where}: {k} of {n} differs"


def _assert_params_equal(snaps, want: dict, where: str):
    for r, snap in enumerate(snaps):
        for n, p in want.items():
            assert torch.equal(snap["params"][n], p), f"{where}: rank {r}'s {n} differs"


@pytest.fixture(scope="module")
def oracle():
    return {"fp32": _oracle(2 * STEPS), "bf16": _oracle(STEPS, dtype="bf16")}


@pytest.fixture
def root():
    path = tempfile.mkdtemp(prefix="zerofast-muon8-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


# --- the test -------------------------------------------------------------------------------------------


def test_8bit_muon_is_the_oracle_bitwise_at_any_world_size_and_checkpoints_reshard(oracle, root):
    params_at, stored_at = oracle["fp32"][STEPS - 1]
    # the momentum's rounding shows in the parameters (the comparisons below could see it missing)
    fp32_momentum = _oracle(STEPS, rounded=False)[STEPS - 1][0]
    assert any(not torch.equal(fp32_momentum[n], p) for n, p in params_at.items())
    results = {2: run_ranks(_world, 2, args=(root, None), timeout=300)}
    results[1] = run_ranks(_world, 1, args=(root, (3, "greedy")), timeout=300)
    results[4] = run_ranks(_world, 4, args=(root, (1, "round_robin")), timeout=300)
    # bitwise the oracle: parameters (every rank's full copy), momentum and AdamW bytes and scales
    for world, outs in results.items():
        for config in CONFIGS + (HYBRID if world == 4 else []):
            stage, partition, dtype, shard_size = config
            want_params, want_stored = oracle[dtype][STEPS - 1]
            size = shard_size or world  # hybrid: each shard group of `size` ranks holds a whole replica
            for first in range(0, world, size):
                where = f"{world} ranks, stage {stage} {partition} {dtype}, ranks {first}..{first + size - 1}"
                snaps = [out[config] for out in outs[first : first + size]]
                _assert_params_equal(snaps, want_params, where)
                placed = _placed(snaps)
                _assert_state_equal(placed, want_stored, where)
                assert set(placed) == set(want_stored) and all(s["steps"] == snaps[0]["steps"] for s in snaps)
        muon_bytes, adam_bytes = zip(*(out["optimizer_bytes"] for out in outs))
        assert muon_bytes == adam_bytes, (world, muon_bytes, adam_bytes)
    # the checkpoint: saved at 2 ranks stage 2 round_robin, loaded at 1 (stage 3 greedy) and 4 (stage 1 round_robin)
    saves = [out["checkpoint"] for out in results[2]]
    saved = _placed([s["saved"] for s in saves])
    _assert_state_equal(saved, stored_at, "saved")
    saved32 = _placed([s["saved32"] for s in saves])
    uninterrupted = [s["uninterrupted"] for s in saves]
    _assert_params_equal(uninterrupted, oracle["fp32"][2 * STEPS - 1][0], "2 ranks, 6 steps")
    _assert_state_equal(_placed(uninterrupted), oracle["fp32"][2 * STEPS - 1][1], "2 ranks, 6 steps")
    code = code_of(MOMENTUM)
    model = _model()
    muon_names = [n for n, _ in model.named_parameters() if _is_muon(model, n)]
    adam_names = [n for n, _ in model.named_parameters() if not _is_muon(model, n)]
    for world in (1, 4):
        loads = [out["checkpoint"] for out in results[world]]
        where = f"2 ranks -> {world}"
        for name in ("q8", "q8_async"):
            snaps = [out[name] for out in loads]
            got = _placed(snaps)
            _assert_state_equal(got, saved, f"{where} ({name})")
            assert all(s["steps"] == saves[0]["saved"]["steps"] for s in snaps), where
        continued = [out["q8_continued"] for out in loads]
        _assert_params_equal(continued, oracle["fp32"][2 * STEPS - 1][0], f"{where}, continued")
        _assert_state_equal(_placed(continued), oracle["fp32"][2 * STEPS - 1][1], f"{where}, continued")
        # 8-bit into fp32 state: the momentum dequantized from the saved bytes and scales
        got = _placed([out["q8_into_fp32"] for out in loads])
        for n, stored in saved.items():
            if MOMENTUM in stored:
                want = dequantize(stored[MOMENTUM].to(torch.uint8), stored[scale_kind(MOMENTUM)], code, BLOCK)
                assert torch.equal(got[n][MOMENTUM], want), f"{where}: {n} 8-bit momentum into fp32"
        got = _placed([out["q8_into_block64"] for out in loads])
        for n, stored in saved.items():
            for kind in stored.keys() - {"master"} - {k for k in stored if k.endswith("_scale")}:
                values = dequantize(stored[kind].to(torch.uint8), stored[scale_kind(kind)], code_of(kind), BLOCK)
                q, scales = quantize(values, code_of(kind), 64)
                assert torch.equal(got[n][kind], q.long()), f"{where}: {kind} of {n} into block 64"
                assert torch.equal(got[n][scale_kind(kind)], scales), f"{where}: {kind} of {n} into block 64"
        # fp32 state into 8-bit: quantized in the matrix's own blocks
        got = _placed([out["fp32_into_q8"] for out in loads])
        for n, stored in saved32.items():
            for kind in stored.keys() - {"master"}:
                q, scales = quantize(stored[kind], code_of(kind), BLOCK)
                assert torch.equal(got[n][kind], q.long()), f"{where}: fp32 {kind} of {n} into 8-bit"
                assert torch.equal(got[n][scale_kind(kind)], scales), f"{where}: fp32 {kind} of {n} into 8-bit"
        # from_torch: to_torch's momentum (fp32) quantized, the master as given
        got = _placed([out["from_torch"] for out in loads])
        model_sd, optim_sd = ck.to_torch(os.path.join(root, "q8"))
        for index, state in optim_sd["muon"][
            "state"
        ].items():  # indexed in model order: [Note: ZeroMuon's torch state dicts]
            n = muon_names[index]
            q, scales = quantize(state["momentum_buffer"].reshape(-1), code, BLOCK)
            assert torch.equal(got[n][MOMENTUM], q.long()) and torch.equal(got[n][scale_kind(MOMENTUM)], scales), n
            assert torch.equal(got[n]["master"], model_sd[n].reshape(-1)), n
    # to_torch: torch.optim.Muon's momentum_buffer is the saved bytes dequantized (= the oracle's
    # rounded buffer), torch.optim.AdamW's moments likewise
    model_sd, optim_sd = ck.to_torch(os.path.join(root, "q8"))
    assert len(optim_sd["muon"]["state"]) == len(muon_names) and len(optim_sd["adamw"]["state"]) == len(adam_names)
    for names, sd, kinds in (
        (muon_names, optim_sd["muon"], (MOMENTUM,)),
        (adam_names, optim_sd["adamw"], ("exp_avg", "exp_avg_sq")),
    ):
        for index, state in sd["state"].items():
            n = names[index]
            for kind in kinds:
                want = dequantize(saved[n][kind].to(torch.uint8), saved[n][scale_kind(kind)], code_of(kind), BLOCK)
                assert torch.equal(state[kind].reshape(-1), want), f"to_torch: {kind} of {n}"
    for n, p in params_at.items():
        assert torch.equal(model_sd[n], p), f"to_torch: {n}"
