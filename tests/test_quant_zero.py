"""8-bit Adam state in ZeroAdam on real gloo ranks: with the same batch on every rank (so the
averaged gradient is exact at 1, 2 and 4 ranks), the parameters and the 8-bit state (code bytes and
block scales, per parameter) are bitwise equal across world sizes, stages 1-3, partitions and hybrid
sharding, and equal to the single-process oracle (zerofast.reference_quant.ReferenceAdam8); also in
bf16 and in fp16 with loss scaling (ZeroMuon's 8-bit state: tests/test_muon_8bit.py).
Cost: about 20 s on 2 cores (three pools, 3 steps of the tiny GPT per configuration)."""

import pytest
import torch
from harness import run_ranks
from models import model_loss
from tolerances import HYPER
from training import rank_batch

from zerofast import CommPolicy, MixedPrecisionPolicy, ZeroAdam
from zerofast.optim.zero_adam import parts_of
from zerofast.reference_quant import ReferenceAdam8
from zerofast.tools.models import make_gpt

STEPS = 3
BLOCK = 32  # small, so the tiny GPT's parameters span several blocks and ranks cut between them
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SCALE = 2.0**6  # fp16's loss scale: a power of two (unscaling is exact), small enough that a sum of 4 never overflows


def _policy(precision: str, block: int = BLOCK) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(DTYPES[precision], state_bits=8, state_block=block)


def _batch(model, step):
    return rank_batch(model, step, 0)  # the same batch on every rank


def _full_state(opt, block) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's pieces of the 8-bit state, placed into per-parameter tensors (elements not
    owned here stay 0; the test adds the ranks' parts)."""
    parts = parts_of(opt)
    shapes = {n: p.numel() for n, p in zip(parts.names, parts.params)}
    out = {}
    for name, offset, q in parts.shard.quantized_pieces():
        n = shapes[name]
        full = out.setdefault(
            name,
            {
                "exp_avg": torch.zeros(n, dtype=torch.int32),
                "exp_avg_sq": torch.zeros(n, dtype=torch.int32),
                "exp_avg_scale": torch.zeros(-(-n // block)),
                "exp_avg_sq_scale": torch.zeros(-(-n // block)),
            },
        )
        k = q["exp_avg"].numel()
        full["exp_avg"][offset : offset + k] += q["exp_avg"].int()
        full["exp_avg_sq"][offset : offset + k] += q["exp_avg_sq"].int()
        b = offset // block
        full["exp_avg_scale"][b : b + q["exp_avg_scale"].numel()] += q["exp_avg_scale"]
        full["exp_avg_sq_scale"][b : b + q["exp_avg_sq_scale"].numel()] += q["exp_avg_sq_scale"]
    return out


def _train(rank, world, stage, partition, precision, block, shard_size):
    model = make_gpt("tiny")
    opt = ZeroAdam(
        model,
        stage,
        comm=CommPolicy(partition=partition, shard_size=shard_size),
        mixed_precision=_policy(precision, block)
        if precision != "fp16"
        else MixedPrecisionPolicy(torch.float16, state_bits=8, state_block=block, loss_scale=_fp16_scaling()),
        **HYPER,
    )
    for step in range(STEPS):
        x, y = _batch(model, step)
        loss = model_loss(model, x, y)
        opt.backward(loss) if precision == "fp16" else loss.backward()
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return params, _full_state(opt, block)


def _fp16_scaling():
    from zerofast import LossScalePolicy

    return LossScalePolicy(init_scale=SCALE, growth_interval=1000)


def _run_matrix(rank, world, configs):
    return {key: _train(rank, world, *cfg) for key, cfg in configs.items()}


def _oracle(precision: str, block: int):
    model = make_gpt("tiny")
    ref = ReferenceAdam8(
        model.parameters(),
        lr=HYPER["lr"],
        betas=HYPER["betas"],
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        block=block,
    )
    model.to(DTYPES[precision])
    scale = SCALE if precision == "fp16" else 1.0
    for step in range(STEPS):
        x, y = _batch(model, step)
        (model_loss(model, x, y) * scale).backward()
        ref.step(grad_scale=1.0 / scale)
        ref.zero_grad()
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    state = {
        n: {
            "exp_avg": st["exp_avg"].int(),
            "exp_avg_sq": st["exp_avg_sq"].int(),
            "exp_avg_scale": st["exp_avg_scale"],
            "exp_avg_sq_scale": st["exp_avg_sq_scale"],
        }
        for n, st in zip(names, ref.state)
    }
    return params, state


def _combine(results, key, shard_size=None):
    """The ranks' parameters (rank 0's, after checking every rank holds the same) and their 8-bit
    state summed over a shard group (each element is owned by one of its ranks, the others hold 0;
    hybrid sharding: ranks g * shard_size + j form shard group g, and every group holds a replica,
    which must be the first group's bitwise)."""
    params0 = results[0][key][0]
    for r, out in enumerate(results[1:], start=1):
        for n, p in out[key][0].items():
            assert torch.equal(p, params0[n]), f"{key}: rank {r} holds other values of {n} than rank 0"
    size = shard_size or len(results)
    replicas = [_sum_state(results[g : g + size], key) for g in range(0, len(results), size)]
    for g, replica in enumerate(replicas[1:], start=1):
        for n, kinds in replica.items():
            for k, v in kinds.items():
                assert torch.equal(v, replicas[0][n][k]), f"{key}: replica {g} holds another {k} of {n}"
    return params0, replicas[0]


def _sum_state(results, key):
    state = {}
    for out in results:
        for n, kinds in out[key][1].items():
            mine = state.setdefault(n, {k: torch.zeros_like(v) for k, v in kinds.items()})
            for k, v in kinds.items():
                mine[k] += v
    return state


def _assert_bitwise(got, want, where):
    params, state = got
    params0, state0 = want
    for n in params0:
        assert torch.equal(params[n], params0[n]), f"{where}: parameter {n} differs from the oracle"
        for k in state0[n]:
            assert torch.equal(state[n][k], state0[n][k]), f"{where}: {k} of {n} differs from the oracle"


CONFIGS = {
    (stage, partition): (stage, partition, "fp32", BLOCK, None)
    for stage in (1, 2, 3)
    for partition in ("flat", "round_robin", "greedy")
}


@pytest.fixture(scope="module")
def oracles():
    # One thread, as every rank runs (tests/harness.py): a matmul's blocking, and so its rounding,
    # may depend on the number of threads.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {(p, b): _oracle(p, b) for p, b in (("fp32", BLOCK), ("bf16", BLOCK), ("fp16", BLOCK), ("fp32", 256))}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_state_is_bitwise_the_oracle_at_any_world_size(world, oracles):
    configs = dict(CONFIGS)
    configs["bf16", 2] = (2, "flat", "bf16", BLOCK, None)
    configs["bf16", 3] = (3, "greedy", "bf16", BLOCK, None)
    configs["fp16", 2] = (2, "flat", "fp16", BLOCK, None)
    configs["block256", 3] = (3, "flat", "fp32", 256, None)
    if world == 4:
        configs["hybrid", 2] = (2, "flat", "fp32", BLOCK, 2)
        configs["hybrid", 3] = (3, "greedy", "fp32", BLOCK, 2)
    results = run_ranks(_run_matrix, world, args=(configs,), timeout=400)
    for key, (_, _, precision, block, shard_size) in configs.items():
        _assert_bitwise(_combine(results, key, shard_size), oracles[precision, block], f"world {world} {key}")
