"""The oracles the multi-rank tests compare against: torch.optim.AdamW on one process over every
rank's batch (plain, with clipping, for Quirky, for any model, and in mixed precision as a PyTorch
user writes it), and torch.library.opcheck of the fused Adam ops."""

from __future__ import annotations

import torch
from models import Quirky, model_loss
from tolerances import HYPER
from training import global_batch, make_scheduler, rank_batch, two_groups

from zerofast.tools.models import make_gpt


def single_process_clipped(world: int, max_norms: list[float]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """AdamW on one process over the global batch, with torch.nn.utils.clip_grad_norm_ at step k's
    max_norms[k] (inf: measure only) before each step; the parameters and the norms it returned."""
    model = make_gpt("tiny")
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    norms = []
    for step, max_norm in enumerate(max_norms):
        total = sum(model(*rank_batch(model, step, r))[1] for r in range(world)) / world
        total.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def single_process_adamw(world: int, steps: int, size: str = "tiny", hyper=HYPER) -> dict[str, torch.Tensor]:
    """torch.optim.AdamW on one process over the concatenation of every rank's batch."""
    model = make_gpt(size)
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **hyper)
    for step in range(steps):
        x, y = global_batch(model, step, world)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def single_process_quirky(world: int, steps: int, groups: bool, scheduler: bool) -> dict[str, torch.Tensor]:
    """The oracle for Quirky: one process, the loss averaged over what each rank would compute."""
    model = Quirky()
    params = two_groups(model) if groups else [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, foreach=False, **HYPER)
    sched = make_scheduler(opt) if scheduler else None
    for step in range(steps):
        total = sum(model(*rank_batch(model, step, r), step, r) for r in range(world)) / world
        total.backward()
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def single_process(model_fn, world: int, steps: int) -> dict[str, torch.Tensor]:
    """torch.optim.AdamW on one process over every rank's batch, for a model returning (_, loss)
    (or a Hugging Face causal LM: see model_loss)."""
    model = model_fn()
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    for step in range(steps):
        total = sum(model_loss(model, *rank_batch(model, step, r)) for r in range(world)) / world
        total.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def single_process_delayed(model_fn, world: int, steps: int) -> dict[str, torch.Tensor]:
    """ZeRO-Offload's one-step-delayed update as its definition: torch.optim.AdamW on one process
    over every rank's batch, each step's gradient computed with the parameters from before the
    previous step's update (W_{t+1} = AdamW(W_t, grad at W_{t-1}), W_{-1} = W_0); returns the
    parameters after every update was applied."""
    model, behind = model_fn(), model_fn()  # AdamW's parameters, and the ones the forward sees
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    for step in range(steps):
        total = sum(model_loss(behind, *rank_batch(behind, step, r)) for r in range(world)) / world
        total.backward()
        with torch.no_grad():
            for p, q in zip(model.parameters(), behind.parameters()):
                p.grad, q.grad = q.grad, None
                q.copy_(p)  # the next forward sees the parameters before this update
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def single_process_mixed(
    world: int,
    steps: int,
    dtype: torch.dtype,
    *,
    reduce_dtype=torch.float32,
    scaler: dict | None = None,
    max_norm: float | None = None,
    hyper=HYPER,
    device: str = "cpu",
):
    """Single-process mixed-precision AdamW as a PyTorch user writes it: the tiny GPT converted with
    model.to(dtype), an fp32 master copy of its parameters that torch.optim.AdamW updates and that is
    copied back, rounded, after each step. Each rank's batch gets its own backward (gradients in the
    model's dtype), summed in reduce_dtype in rank order, as a data-parallel reduce does; the master
    gradient is that sum over world. For fp16, torch.amp.GradScaler(**scaler) scales the loss,
    unscales, skips steps with inf or nan and updates its scale; torch.nn.utils.clip_grad_norm_ clips
    the master gradients when max_norm is given.

    Returns (model parameters as float32, master copy, [(scale used, skipped, norm or None)] per step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank runs: the same matmul blocking, the same rounding
    try:
        model = make_gpt("tiny").to(device)
        names = [n for n, _ in model.named_parameters()]
        master = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        model.to(dtype)
        params = list(model.parameters())
        opt = torch.optim.AdamW(master, foreach=False, **hyper)
        gs = torch.amp.GradScaler(torch.device(device).type, **scaler) if scaler is not None else None
        history = []
        for step in range(steps):
            total = None
            for r in range(world):
                _, loss = model(*(t.to(device) for t in rank_batch(model, step, r)))
                if gs is not None:
                    loss = gs.scale(loss)
                grads = [g.to(reduce_dtype) for g in torch.autograd.grad(loss, params)]
                total = grads if total is None else [t + g for t, g in zip(total, grads)]
            for m, t in zip(master, total):
                m.grad = t.float() / world
            scale = gs.get_scale() if gs is not None else 1.0
            before = float(opt.state[master[0]].get("step", 0)) if master[0] in opt.state else 0.0
            if gs is not None:
                gs.unscale_(opt)
            norm = None
            if max_norm is not None:
                norm = float(torch.nn.utils.clip_grad_norm_(master, max_norm))
            if gs is not None:
                gs.step(opt)
                gs.update()
            else:
                opt.step()
            after = float(opt.state[master[0]].get("step", 0)) if master[0] in opt.state else 0.0
            history.append((scale, after == before, norm))
            with torch.no_grad():
                for p, m in zip(params, master):
                    p.copy_(m)
        return (
            {n: p.detach().float().cpu() for n, p in zip(names, params)},
            {n: m.detach().cpu() for n, m in zip(names, master)},
            history,
        )
    finally:
        torch.set_num_threads(threads)


def opcheck_adam_op(op, args, n: int, device, **kw) -> None:
    """torch.library.opcheck of a fused Adam op (fused_adam_, fused_adam_8bit_) twice, on fresh
    tensors from args() each time: its optional tensors absent, then present (found_inf, an fp16
    param_copy, a grad_scale tensor), then with follow_copy reading that copy; kw: the op's own keyword
    arguments and overrides."""
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1, adamw=True, grad_scale=1.0) | kw
    kw.update(grad_scale_tensor=None, found_inf=None, param_copy=None)
    torch.library.opcheck(op, args(), kw)
    kw.update(
        found_inf=torch.zeros(1, device=device),
        param_copy=torch.empty(n, device=device).half(),
        grad_scale_tensor=torch.ones(1, device=device),
    )
    torch.library.opcheck(op, args(), kw)
    kw.update(found_inf=None, param_copy=torch.randn(n, device=device).half(), follow_copy=True)
    torch.library.opcheck(op, args(), kw)
