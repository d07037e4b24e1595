"""ZeroMuon: Muon (torch.optim.Muon) on the 2-D hidden matrices and AdamW on the rest, with ZeRO
stage 1, 2 or 3 sharding, under the plain training loop.

    opt = ZeroMuon(model, stage=2, lr=0.02, adamw_lr=3e-4)
    loss.backward(); opt.step(); opt.zero_grad()

Goals: exactly single-process torch.optim.Muon (the matrices) + torch.optim.AdamW (the rest) on the
global batch; Newton-Schulz once per matrix per step across all ranks; no collective beyond ZeroAdam's.
Here: Muon's math (torch's, op for op), MuonShard (the owner's step), select_muon, MuonUpdate, ZeroMuon.

[Note: Muon on whole-matrix owners]
Muon orthogonalizes each matrix's update with Newton-Schulz, which needs the whole matrix: a flat
(intra-tensor) partition leaves every rank a slice, and Distributed Muon (Moonlight) all-gathers the
slices, runs Newton-Schulz on the whole matrix on every rank and keeps its own slice: an extra
collective per step and N-fold repeated Newton-Schulz. The owner partitions ("greedy", "round_robin")
already give each tensor one owner: phase 2 reduces each whole gradient to its owner, phase 4
broadcasts each whole parameter from it. So ZeroMuon is ZeroAdam's sibling over one front
(ZeroOptimizer: the layout, gradient path, phase 2, phase 4's gather, stage 3's units and checkpoints
stay) with another update rule (MuonUpdate), whose phase 3 differs: a Muon matrix's owner runs torch's
Muon step on it (momentum, Newton-Schulz, weight decay, the adjusted lr), the fused AdamW kernel runs
over the rest of the shard, and the existing gather distributes the updated matrix. Newton-Schulz
runs in step(), never per micro-batch, and greedy balances its cost ([Note: balancing Newton-Schulz]).
"flat" is rejected: it is what the design avoids.

[Note: balancing Newton-Schulz]
An m x n matrix costs ns_steps * (4 p^2 q + 2 p^3) FLOPs (p = min, q = max: partition.newton_schulz_flops)
and Newton-Schulz dominates the step (thousands of FLOPs per element against AdamW's ~10), so the
step's makespan is the busiest rank's Newton-Schulz. "greedy" (balance="cost", the default) assigns
the matrices by that cost, costliest first, to the rank with the least so far, then the AdamW tensors
by elements to the rank with the fewest (their time is noise; their state is memory):
partition.greedy_by_cost. balance="numel" is ZeroAdam's greedy (elements only), for comparison.

[Note: Muon's gradient]
The owner's gradient range holds the sum over ranks of the (fp16: loss-scaled) gradients; ZeroAdam
folds 1/N, 1/scale and the clip coefficient into the Adam kernel's grad_scale. The Muon step applies
the same factor to the gradient before the momentum (torch's Muon sees the averaged, unscaled, clipped
gradient), in fp32: with a factor of exactly 1 (one rank, no scaling, no clipping) the gradient is used
as is, so one rank is bitwise torch.optim.Muon. Clipping's norm is phase 2's global norm over the raw
gradients of every parameter, Muon's and AdamW's alike, as torch.nn.utils.clip_grad_norm_ sees them.

[Note: Muon's 8-bit momentum]
With MixedPrecisionPolicy(state_bits=8) each matrix's momentum buffer is kept as Adam's exp_avg is
([Note: quantized state] in zerofast/quant.py): the signed dynamic code, one fp32 scale per block of
the matrix's own elements, in exp_avg's slot ([Note: Muon's momentum in exp_avg's slot] in state.py).
The owner's step, per matrix: dequantize the momentum (zerofast.quant.dequantize) into an fp32 matrix,
run muon_update_ on it unchanged (the lerp, Nesterov's lerp and Newton-Schulz read this step's new fp32
momentum), then quantize that new momentum (zerofast.quant.quantize) into the bytes and scales. So, as
in the 8-bit Adam kernel, the rounding to 8 bits affects the next step, never this one: the step is
torch.optim.Muon's with its momentum_buffer replaced by quantize -> dequantize of itself after every
step, and the stored bytes are quantize() of the momentum before that rounding.
The matrix is whole on its owner and starts at a block boundary, so its blocks are the parameter's
and the bytes are the same at any world size, stage and partition. The only fp32 momentum is that of
the matrix in flight (freed when the next matrix is dequantized). A momentum that was never written
dequantizes to zero (its scales are 0), which is torch's first step (a zero buffer).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from ..config import CommPolicy, _is_number, comm_policy, offload_policy, reject_moved, resolve_plan
from ..layout import Piece
from ..partition import newton_schulz_flops
from .base import ZeroOptimizer
from .builder import trainable_params
from .state import ShardState, follow
from .update import check_hyper

__all__ = ["ZeroMuon", "zeropower_via_newtonschulz", "muon_update_", "adjust_lr", "newton_schulz_calls"]

# torch.optim.Muon's defaults (torch/optim/_muon.py: Keller Jordan's constants).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7
ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")  # torch's choices
MUON_KEYS = ("lr", "momentum", "nesterov", "weight_decay", "ns_coefficients", "ns_steps", "eps", "adjust_lr_fn")
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")
BALANCES = ("cost", "numel")

_ns_calls = 0  # Newton-Schulz runs in this process (the tests count them across ranks)


def newton_schulz_calls() -> int:
    """How many times this process has run Newton-Schulz (zeropower_via_newtonschulz)."""
    return _ns_calls


# --- the math: torch.optim.Muon's, op for op ---------------------------------------------------------
# Written out rather than imported from torch.optim._muon (a private module) so that the counter lives
# here; the same ops in the same order as torch 2.14's _single_tensor_muon, which tests/test_muon.py checks
# bitwise.


def zeropower_via_newtonschulz(grad: torch.Tensor, ns_coefficients, ns_steps: int, eps: float) -> torch.Tensor:
    """torch's quintic Newton-Schulz orthogonalization of a 2-D matrix, in bf16 as torch runs it
    (the iteration tolerates bf16's rounding; the result is applied to the fp32 parameter)."""
    global _ns_calls
    _ns_calls += 1
    a, b, c = ns_coefficients
    ortho = grad.bfloat16()
    tall = grad.size(0) > grad.size(1)
    if tall:
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if tall else ortho


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    """torch.optim.Muon's learning-rate adjustment for a matrix of `shape` (fan-out, fan-in)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    elif adjust_lr_fn == "spectral_unclamped":
        ratio = math.sqrt(rows / cols)
    else:
        ratio = 1.0
    return lr * ratio


def muon_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients,
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
) -> None:
    """One torch.optim.Muon step of one fp32 matrix, in place (param and momentum_buffer)."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    update = grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
    update = zeropower_via_newtonschulz(update, ns_coefficients, ns_steps, eps)
    param.mul_(1 - lr * weight_decay)  # decoupled weight decay with the unadjusted lr, as torch
    param.add_(update, alpha=-adjust_lr(lr, adjust_lr_fn, tuple(param.shape)))


# --- phase 3 over this rank's owned matrices ----------------------------------------------------------


class MuonShard:
    """This rank's owned Muon matrices (whole tensors: [Note: Muon on whole-matrix owners]), each a
    piece of the ShardState addressed through its accessors: its reduced gradient, its fp32 master
    (and low-precision copy), and its momentum buffer ([Note: Muon's momentum in exp_avg's slot])."""

    def __init__(self, shard: ShardState, is_muon: list[bool], shapes: list[tuple[int, ...]], names: list[str]):
        self.shard, self.shapes = shard, shapes
        self.pieces: list[Piece] = [pc for pc in shard.pieces if is_muon[pc.param]]
        for pc in self.pieces:  # an owner partition never splits a tensor; say so if that ever changes
            if pc.param_offset != 0 or pc.numel != math.prod(shapes[pc.param]):
                raise RuntimeError(
                    f"ZeroMuon: {names[pc.param]} is split across ranks (elements "
                    f"{pc.param_offset}..{pc.param_offset + pc.numel} of {math.prod(shapes[pc.param])}); "
                    f"Muon needs each matrix whole on its owner"
                )

    def apply(
        self, used: list[bool], param_groups: list[dict], group_of: list[int], grad_scale: float | torch.Tensor
    ) -> None:
        """Muon's step for every owned, used matrix; the gradient range times grad_scale is the
        averaged, unscaled, clipped gradient ([Note: Muon's gradient]). `used` is phase 2's agreement
        restricted to Muon's matrices, the same on every rank, so every rank counts the same steps."""
        shard = self.shard
        for pc in self.pieces:
            if not used[pc.param]:
                continue
            shape, group = self.shapes[pc.param], param_groups[group_of[pc.param]]
            state = slice(pc.state_offset, pc.state_offset + pc.numel)
            grad = shard.grad_range(pc.bucket, pc.bucket_offset, state).view(shape)
            if grad.dtype != torch.float32 or isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
                grad = grad.to(torch.float32) * grad_scale
            master, copy = shard.master_and_copy(pc.bucket, pc.bucket_offset, state)
            if copy is not None and shard.follows_params:  # what the model holds, if written since
                follow(master, copy)
            quantized = shard.plan.quantized_state  # 8-bit: an fp32 copy in flight ([Note: Muon's 8-bit momentum])
            read = shard.dequantized if quantized else shard.piece_view
            momentum = read(pc, "momentum_buffer")
            muon_update_(master.view(shape), grad, momentum.view(shape), **{k: group[k] for k in MUON_KEYS})
            if quantized:
                shard.write_piece(pc, "momentum_buffer", momentum)
            if copy is not None:  # the low-precision parameter: the master's rounding, as the Adam kernel leaves it
                copy.copy_(master)
        shard.count_steps(used)


# --- which parameters Muon takes ----------------------------------------------------------------------

MuonParams = None | Callable[[str, nn.Parameter], bool] | Iterable[nn.Parameter | str]


def select_muon(model: nn.Module, named: list[tuple[str, nn.Parameter]], muon_params: MuonParams) -> list[bool]:
    """For each trainable (name, parameter), whether Muon updates it. muon_params None: every 2-D
    parameter that is not an nn.Embedding's weight (a tied output head is that weight, so it stays
    AdamW); a callable (name, parameter) -> bool; or a collection of parameters or names (frozen ones
    are ignored: nothing updates them)."""
    if muon_params is None:
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        chosen = [p.ndim == 2 and id(p) not in embeddings for _, p in named]
    elif callable(muon_params):
        chosen = [bool(muon_params(n, p)) for n, p in named]
    else:
        if isinstance(muon_params, (str, torch.Tensor)):
            raise TypeError(
                f"ZeroMuon: muon_params must be None, a callable (name, parameter) -> bool, or a "
                f"collection of parameters or names; got a single {type(muon_params).__name__}"
            )
        all_ids = {id(p) for p in model.parameters()}
        all_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        ids = set()
        for item in muon_params:
            if isinstance(item, str):
                if item not in all_names:
                    raise ValueError(f"ZeroMuon: muon_params names {item!r}, which is not a parameter of the model")
                ids.add(id(model.get_parameter(item)))
            elif isinstance(item, torch.Tensor):
                if id(item) not in all_ids:
                    raise ValueError(
                        f"ZeroMuon: muon_params holds a tensor of shape {tuple(item.shape)} that is "
                        f"not a parameter of the model"
                    )
                ids.add(id(item))
            else:
                raise TypeError(
                    f"ZeroMuon: muon_params must hold parameters or parameter names; got {type(item).__name__} {item!r}"
                )
        chosen = [id(p) in ids for _, p in named]
    for (name, p), c in zip(named, chosen):
        if c and p.ndim != 2:
            raise ValueError(
                f"ZeroMuon: muon_params selects {name} of shape {tuple(p.shape)}; Muon updates 2-D "
                f"matrices only (pass muon_params to leave it to AdamW)"
            )
    return chosen


def check_muon_hyper(where: str, g: dict) -> None:
    """A Muon group's hyper-parameters (torch.optim.Muon's checks, with the argument and value named)."""
    for key in ("lr", "momentum", "weight_decay", "eps"):
        if not (_is_number(g[key]) and g[key] >= 0):
            raise ValueError(f"ZeroMuon{where}: {key} must be a number >= 0; got {g[key]!r}")
    if not isinstance(g["nesterov"], bool):
        raise ValueError(f"ZeroMuon{where}: nesterov must be True or False; got {g['nesterov']!r}")
    steps = g["ns_steps"]
    if not (isinstance(steps, int) and not isinstance(steps, bool) and 1 <= steps < 100):
        raise ValueError(f"ZeroMuon{where}: ns_steps must be an integer in [1, 100); got {steps!r}")
    coef = g["ns_coefficients"]
    if not (isinstance(coef, (tuple, list)) and len(coef) == 3 and all(_is_number(c) for c in coef)):
        raise ValueError(f"ZeroMuon{where}: ns_coefficients must be three numbers (a, b, c); got {coef!r}")
    if g["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(
            f"ZeroMuon{where}: adjust_lr_fn must be one of {', '.join(map(repr, ADJUST_LR_FNS))}; "
            f"got {g['adjust_lr_fn']!r}"
        )


# --- ZeroMuon's update rule: what it gives the builder ---------------------------------------------


class MuonUpdate:
    """ZeroMuon's rule (zerofast/optim/update.py): two groups, Muon's matrices and AdamW's rest;
    greedy balancing Newton-Schulz ([Note: balancing Newton-Schulz]); a matrix keeps a momentum
    buffer, the rest Adam's moments; phase 3 the fused AdamW kernel, then Muon on the owned matrices."""

    def __init__(self, named, is_muon: list[bool], muon_hyper: dict, adamw_defaults: dict, balance: str):
        self.is_muon = is_muon
        muon = [p for (_, p), m in zip(named, is_muon) if m]
        adamw = [p for (_, p), m in zip(named, is_muon) if not m]
        self.groups = []  # a group with no parameters is left out
        if muon:
            self.groups.append(dict(muon_hyper, params=muon, use_muon=True))
        if adamw:
            self.groups.append(dict({k: adamw_defaults[k] for k in ADAMW_KEYS}, params=adamw, use_muon=False))
        self.defaults = adamw_defaults
        steps = muon_hyper["ns_steps"]
        self.step_costs = [newton_schulz_flops(tuple(p.shape), steps) if m else 0 for (_, p), m in zip(named, is_muon)]
        self.partition_costs = self.step_costs if balance == "cost" else None

    def state_kinds(self, index: int) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.is_muon[index] else ("exp_avg", "exp_avg_sq")

    def check_group(self, index: int, group: dict) -> None:
        if group.get("use_muon"):
            check_muon_hyper(f".param_groups[{index}]", group)
        else:
            check_hyper(f".param_groups[{index}]", group, "ZeroMuon")

    def phase3(self, shard: ShardState, names: list[str], params: list, group_of: list[int], adam):
        """Fused AdamW over the non-Muon parameters' owned ranges, then Muon on the owned matrices."""
        is_muon = self.is_muon
        matrices = MuonShard(shard, is_muon, [tuple(p.shape) for p in params], names)

        def update(used: list[bool], param_groups: list[dict], grad_scale: float | torch.Tensor) -> None:
            adamw_used = [u and not m for u, m in zip(used, is_muon)]
            with torch.profiler.record_function("zerofast::adam"):
                adam.apply_adam(adamw_used, param_groups, group_of, True, grad_scale)
            with torch.profiler.record_function("zerofast::muon"):
                matrices.apply([u and m for u, m in zip(used, is_muon)], param_groups, group_of, grad_scale)

        return update


# --- the optimizer front -------------------------------------------------------------------------------


class ZeroMuon(ZeroOptimizer):
    """Muon on the model's 2-D hidden matrices and AdamW on everything else, each matrix's Muon step
    run once by its owner, with ZeRO stage 1, 2 or 3 sharding across `process_group`
    ([Note: Muon on whole-matrix owners]).

    model, stage, max_grad_norm, mixed_precision, units, process_group: as ZeroAdam's; with
      MixedPrecisionPolicy(state_bits=8) the AdamW part keeps 8-bit moments as ZeroAdam does and
      each matrix's momentum is 8-bit too ([Note: Muon's 8-bit momentum]).
    lr, momentum, nesterov, weight_decay, ns_steps, ns_coefficients, eps, adjust_lr_fn: the Muon
      part, as torch.optim.Muon's (and its defaults).
    adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the rest, as torch.optim.AdamW's (and
      its defaults).
    muon_params: which trainable parameters Muon updates: None (every 2-D parameter that is not an
      nn.Embedding's weight, so a tied output head stays AdamW; an untied head is a Linear, so pass
      muon_params to leave it to AdamW), a callable (name, parameter) -> bool, or a collection of
      parameters or parameter names.
    comm: a CommPolicy whose partition is "greedy" (default) or "round_robin"; "flat" splits matrices.
    offload: not supported (a named error): Newton-Schulz needs whole matrices on the device.
    balance: greedy's measure: "cost" (Newton-Schulz FLOPs, then elements: [Note: balancing
      Newton-Schulz]) or "numel" (elements only, as ZeroAdam's greedy).
    opt.param_groups: [the Muon group (use_muon=True), the AdamW group (use_muon=False)] (a group
      with no parameters is left out); an LR scheduler sets each group's lr.
    report()'s partition adds each rank's Newton-Schulz FLOPs.
    """

    def __init__(
        self,
        model: nn.Module,
        stage: int = 2,
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        ns_steps: int = NS_STEPS,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = EPS,
        adjust_lr_fn: str | None = None,
        *,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        muon_params: MuonParams = None,
        balance: str = "cost",
        max_grad_norm: float | None = None,
        mixed_precision=None,
        units=None,
        comm=None,
        process_group=None,
        offload=None,
        **moved,
    ):
        reject_moved("ZeroMuon", moved)
        if offload_policy(offload).active:
            raise ValueError(
                f"ZeroMuon: offload={offload!r} is not supported: the offloaded step streams the state "
                "elementwise through the fused CPU Adam kernel, and Muon's Newton-Schulz needs each "
                "owned matrix's whole gradient and momentum as matrices on the device; use ZeroAdam "
                "with offload, or ZeroMuon without it"
            )
        named = trainable_params(model, "ZeroMuon")
        comm = CommPolicy(partition="greedy") if comm is None else comm_policy(comm)
        if comm.partition == "flat":
            raise ValueError(
                "ZeroMuon: comm=CommPolicy(partition='flat') cuts matrices across ranks, and Muon's "
                "Newton-Schulz needs each matrix whole; use partition='greedy' (the default) or "
                "'round_robin', which give each matrix one owner"
            )
        if balance not in BALANCES:
            raise ValueError(f"ZeroMuon: balance must be one of {', '.join(map(repr, BALANCES))}; got {balance!r}")
        muon_hyper = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_coefficients=tuple(ns_coefficients) if isinstance(ns_coefficients, (tuple, list)) else ns_coefficients,
            ns_steps=ns_steps,
            eps=eps,
            adjust_lr_fn=adjust_lr_fn,
        )
        check_muon_hyper("", muon_hyper)
        plan = resolve_plan(
            stage,
            adamw=True,
            max_grad_norm=max_grad_norm,
            mixed_precision=mixed_precision,
            comm=comm,
            units=units,
            who="ZeroMuon",
        )
        adamw_defaults = dict(lr=adamw_lr, betas=_tuple(adamw_betas), eps=adamw_eps, weight_decay=adamw_weight_decay)
        check_hyper("", adamw_defaults, "ZeroMuon")
        rule = MuonUpdate(named, select_muon(model, named, muon_params), muon_hyper, adamw_defaults, balance)
        self._wire(model, plan, process_group, rule)

    @property
    def muon_names(self) -> list[str]:
        """The trainable parameters Muon updates, by name, in the optimizer's order."""
        part = self.checkpoint_view.trainable
        return [n for (n, _), kinds in zip(part.params, part.kinds) if "momentum_buffer" in kinds]


def _tuple(value):
    return tuple(value) if isinstance(value, (tuple, list)) else value
