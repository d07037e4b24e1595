"""Checkpoints of 8-bit Adam state (zerofast.checkpoint, [Note: 8-bit checkpoints]) on real gloo
ranks: saved as stored (code bytes and block scales per parameter) at 2 ranks in stage 2, loaded
at 1 rank in stage 3 and at 3 ranks in stage 1 with the state bitwise as saved, and training
continuing bitwise as if uninterrupted (at 1 rank: the same batch on every rank makes the averaged
gradient exact at 1, 2 and 4 ranks, so 8-bit state is world-size invariant there); an fp32-state checkpoint loads into an 8-bit run quantized, an 8-bit one into an fp32
run dequantized, both bitwise as zerofast.quant computes them; an asynchronous save writes the same;
to_torch dequantizes. Cost: about 15 s on 2 cores (three launches: 2, 1 and 3 ranks)."""

import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from probes import full_master
from tolerances import HYPER
from training import train_same_batch

from zerofast import CommPolicy, MixedPrecisionPolicy, ZeroAdam
from zerofast import checkpoint as ck
from zerofast.quant import code_of, dequantize, num_blocks, quantize
from zerofast.tools.models import make_gpt

STEPS = 3
BLOCK = 32  # small: the tiny GPT's parameters span several blocks, and ranks cut between them
MOMENTS = ("exp_avg", "exp_avg_sq")
STORED = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")


@pytest.fixture
def root():
    path = tempfile.mkdtemp(prefix="zerofast-ckpt8-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _shapes():
    return {n: tuple(p.shape) for n, p in make_gpt("tiny").named_parameters()}


def _make(stage, partition, bits, seed=0):
    model = make_gpt("tiny", seed=seed)
    group = dist.new_group(list(range(dist.get_world_size())))  # a fresh process group for each optimizer
    opt = ZeroAdam(
        model,
        stage,
        comm=CommPolicy(partition=partition),
        mixed_precision=MixedPrecisionPolicy(state_bits=bits, state_block=BLOCK),
        process_group=group,
        **HYPER,
    )
    return model, opt


def _train(model, opt, start):
    train_same_batch(model, opt, start, STEPS)


def _snapshot(model, opt) -> dict:
    """The full parameters, the step counts, this rank's pieces of the master and of the moments as
    fp32 values (state_pieces: dequantized for 8-bit state), and of 8-bit state as stored."""
    part = opt.checkpoint_view.trainable
    with opt.gathered_params():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = dict(params=params, steps=opt.checkpoint_view.step_counts())
    out.update({k: part.state_pieces(k) for k in ("master", *MOMENTS)})
    if part.state_block:
        out["stored"] = [
            (part.params[pc.param][0], pc.param_offset, {k: part.piece_view(pc, k).clone() for k in STORED})
            for pc in part.pieces
        ]
    return out


def _full(snapshots, kind):
    return full_master([s[kind] for s in snapshots], _shapes())


def _full_stored(snapshots) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank's 8-bit pieces placed into per-parameter tensors (codes as int64, scales fp32; the
    pieces are disjoint, so summing the ranks' parts places each once)."""
    numel = {n: torch.Size(s).numel() for n, s in _shapes().items()}
    out = {
        n: {
            **{k: torch.zeros(m, dtype=torch.int64) for k in MOMENTS},
            **{k + "_scale": torch.zeros(num_blocks(m, BLOCK)) for k in MOMENTS},
        }
        for n, m in numel.items()
    }
    for snap in snapshots:
        for name, offset, stored in snap["stored"]:
            for k in MOMENTS:
                out[name][k][offset : offset + stored[k].numel()] += stored[k].long()
                b = offset // BLOCK
                out[name][k + "_scale"][b : b + stored[k + "_scale"].numel()] += stored[k + "_scale"]
    return out


def _save(rank, world, root):
    """2 ranks, stage 2: an 8-bit run saved after 3 steps (blocking and asynchronously), then 3 more
    steps; an fp32-state run saved after 3 steps."""
    model, opt = _make(2, "flat", 8)
    _train(model, opt, 0)
    ck.save(os.path.join(root, "q8"), model, opt)
    ck.save(os.path.join(root, "q8-async"), model, opt, blocking=False).wait()
    saved = _snapshot(model, opt)
    _train(model, opt, STEPS)
    uninterrupted = _snapshot(model, opt)
    model, opt = _make(2, "flat", 32)
    _train(model, opt, 0)
    ck.save(os.path.join(root, "fp32"), model, opt)
    return saved, uninterrupted, _snapshot(model, opt)


def _load(rank, world, root, stage, partition):
    out = {}
    for name, source, bits in (
        ("q8", "q8", 8),
        ("q8_async", "q8-async", 8),
        ("q8_into_fp32", "q8", 32),
        ("fp32_into_q8", "fp32", 8),
    ):
        model, opt = _make(stage, partition, bits, seed=7)  # other initial values: all must come from the file
        ck.load(os.path.join(root, source), model, opt)
        out[name] = _snapshot(model, opt)
        if name == "q8" and world != 3:
            _train(model, opt, STEPS)
            out["q8_continued"] = _snapshot(model, opt)
    return out


def _assert_stored_equal(got, want, where):
    for n in want:
        for k in STORED:
            assert torch.equal(got[n][k], want[n][k]), f"{where}: {n} {k} differs"


def test_8bit_checkpoints_reshard_and_convert_bitwise(root):
    saved, uninterrupted, saved32 = zip(*run_ranks(_save, 2, args=(root,)))
    want_stored, want_master = _full_stored(saved), _full(saved, "master")
    want_moments = {k: _full(saved, k) for k in MOMENTS}  # dequantized
    # Training continues bitwise where the averaged gradient of equal batches is exact (1, 2 or 4
    # ranks; 3 equal gradients summed may round), so 3 ranks check the load only.
    for world, stage, partition in ((1, 3, "greedy"), (3, 1, "round_robin")):
        loaded = run_ranks(_load, world, args=(root, stage, partition))
        where = f"2 ranks stage 2 -> {world} ranks stage {stage}"
        for name in ("q8", "q8_async"):
            snaps = [out[name] for out in loaded]
            _assert_stored_equal(_full_stored(snaps), want_stored, f"{where} ({name})")
            master = _full(snaps, "master")
            assert all(torch.equal(master[n], want_master[n]) for n in want_master), f"{where}: master"
            assert all(s["steps"] == saved[0]["steps"] for s in snaps), where
        if world != 3:
            continued = [out["q8_continued"] for out in loaded]
            _assert_stored_equal(_full_stored(continued), _full_stored(uninterrupted), f"{where}, 3 more steps")
            for snap in continued:
                assert all(torch.equal(snap["params"][n], p) for n, p in uninterrupted[0]["params"].items()), where
        # 8-bit into fp32 state: the dequantized values
        snaps = [out["q8_into_fp32"] for out in loaded]
        for k in MOMENTS:
            got = _full(snaps, k)
            assert all(torch.equal(got[n], want_moments[k][n]) for n in got), f"{where}: {k} into fp32"
        # fp32 state into 8-bit: each parameter's moments quantized in its own blocks
        got = _full_stored([out["fp32_into_q8"] for out in loaded])
        for k in MOMENTS:
            for n, values in _full(saved32, k).items():
                q, scales = quantize(values.reshape(-1), code_of(k), BLOCK)
                assert torch.equal(got[n][k], q.long()) and torch.equal(got[n][k + "_scale"], scales), (
                    f"{where}: fp32 {n} {k} into 8-bit"
                )
    # to_torch: torch.optim.AdamW's state, dequantized
    _, optim = ck.to_torch(os.path.join(root, "q8"))
    names = list(_shapes())
    for index, state in optim["state"].items():
        n = names[index]
        for k in MOMENTS:
            stored = want_stored[n]
            expect = dequantize(stored[k].to(torch.uint8), stored[k + "_scale"], code_of(k), BLOCK)
            assert torch.equal(state[k], expect.view(state[k].shape)), f"to_torch: {n} {k}"
    assert len(optim["state"]) == len(names)
