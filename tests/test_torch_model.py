"""The model stays a torch model under ZeroAdam ([Note: the model stays a torch model] in
zerofast/guard/__init__.py): the calls a PyTorch user makes on the model after building the optimizer,
at stages 1-3, fp32 and bf16, on 2 gloo ranks, against the same calls on the plain model with
torch.optim.AdamW in one process over every rank's batch (what DDP computes), or the named error.

One script of calls (_script) runs on both sides: torch.nn.init and model.apply writes, p.mul_ and
p.copy_, torch.nn.utils.clip_grad_norm_ and clip_grad_value_, model.to(where it is), .cpu(),
.float() / .bfloat16(), model.state_dict() saved with torch.save and loaded into a plain model, and
model.load_state_dict() of new values; then the conversions and reads that cannot be served.
Tolerances: tests/tolerances.py (fp32_tol per step; in bf16 lp_param_tol and low_precision_tol; the
norms norm_rel_tol of the elements summed, or one bf16 ulp where the gradients are bf16)."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn as nn
from harness import run_ranks
from models import model_loss
from probes import full_master
from tolerances import HYPER, ULP_REL, fp32_tol, low_precision_tol, lp_param_tol, max_abs_diff, norm_rel_tol
from training import rank_batch

from zerofast.tools.models import make_gpt

WORLD = 2
STEPS = 4  # training steps of the script
MAX_NORMS = (0.05, math.inf, 1.0, 0.02)  # torch.nn.utils.clip_grad_norm_'s max_norm at each step
CLIP_VALUE_STEP, CLIP_VALUE = 1, 0.002  # clip_grad_value_ at this step, before the norm is measured
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _new_values(like: nn.Module) -> dict[str, torch.Tensor]:
    """A state dict of new parameter values (fp32, the same in every process): what a user loads."""
    g = torch.Generator().manual_seed(11)
    new = {id(p): p.detach().float() + 0.05 * torch.randn(p.shape, generator=g) for p in like.parameters()}
    return {k: new.get(id(v), v) for k, v in like.state_dict(keep_vars=True).items()}  # a tied one: one value


def _init(module: nn.Module) -> None:
    """A model.apply() initializer as Hugging Face's _init_weights writes them: through .data."""
    if isinstance(module, nn.Linear):
        module.weight.data.normal_(0.0, 0.02)
        if module.bias is not None:
            module.bias.data.zero_()


class _Side:
    """What differs between the two sides of the script: how a step is taken and what the master is."""

    def backward(self, model, step: int) -> None: ...

    def step(self, model) -> None: ...

    def whole(self, model) -> dict[str, torch.Tensor]: ...  # every state_dict() entry, whole, in fp32

    def grads(self, model) -> list[torch.Tensor]:  # what torch's clip functions are given
        return list(model.parameters())

    def written(self, model) -> None:  # after writes: the oracle's master follows what the model holds
        pass


def _script(model, side: _Side, precision: str) -> dict:
    """The calls, in order, and what they gave."""
    out: dict = {"norms": [], "errors": {}}
    torch.manual_seed(7)
    with torch.no_grad():
        nn.init.constant_(model.blocks[0].ln1.weight, 0.5)
        model.apply(_init)
        model.wpe.weight.mul_(0.5)
        model.ln_f.bias.copy_(torch.linspace(-0.1, 0.1, 16))
    side.written(model)
    out["after writes"] = side.whole(model)
    for step in range(STEPS):
        side.backward(model, step)
        if step == CLIP_VALUE_STEP:
            torch.nn.utils.clip_grad_value_(side.grads(model), CLIP_VALUE)
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(side.grads(model), MAX_NORMS[step])))
        side.step(model)
        if step == 1:  # moves to where the model is, and the cast to its own dtype: it keeps training
            model.to(torch.device("cpu:0"))
            model.cpu()
            model.float() if precision == "fp32" else model.bfloat16()
        if step == 2:
            model.load_state_dict(_new_values(make_gpt("tiny")))
            side.written(model)
            out["after load"] = side.whole(model)
    out["final"] = side.whole(model)
    return out


# --- ZeroAdam's side ------------------------------------------------------------------------------------


class _Zero(_Side):
    def __init__(self, opt, rank: int):
        self.opt, self.rank = opt, rank

    def backward(self, model, step: int) -> None:
        model_loss(model, *rank_batch(model, step, self.rank)).backward()

    def step(self, model) -> None:
        self.opt.step()
        self.opt.zero_grad()

    def whole(self, model) -> dict[str, torch.Tensor]:
        return {k: v.float() for k, v in self.opt.full_state_dict().items()}


def _expect(errors: dict, key: str, error: type, call) -> None:
    """Record what call() raised (its class and message), or that it raised nothing."""
    try:
        call()
        errors[key] = "no error"
    except error as e:
        errors[key] = f"{type(e).__name__}: {e}"


def _zero_rank(rank, world, stage, precision):
    from zerofast import MixedPrecisionPolicy, ZeroAdam
    from zerofast.errors import ModelConversionError, ShardedGradientError, ShardedParameterError

    model = make_gpt("tiny")
    plain = make_gpt("tiny").to(DTYPES[precision])
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" else None
    opt = ZeroAdam(model, stage=stage, mixed_precision=mp, **HYPER)
    meta = lambda m: [(n, tuple(p.shape), p.dtype, p.device, p.requires_grad) for n, p in m.named_parameters()]  # noqa: E731
    out = _script(model, _Zero(opt, rank), precision)
    out["metadata equal"] = meta(model) == meta(plain)
    out["master"] = opt.checkpoint_view.trainable.state_pieces("master")
    errors = out["errors"]
    x, y = rank_batch(model, 0, rank)
    # The gradient between backward and step(): a read other than clipping is a named error.
    model_loss(model, x, y).backward()
    _expect(errors, "grad read", ShardedGradientError, lambda: model.wte.weight.grad.abs())
    _expect(errors, "model.zero_grad() before step", RuntimeError, model.zero_grad)
    opt.step()
    opt.zero_grad()
    # Conversions the shards and the state cannot follow, before anything changes.
    other = torch.float16 if precision == "fp32" else torch.float32
    _expect(errors, "double", ModelConversionError, model.double)
    _expect(errors, "half or float", ModelConversionError, lambda: model.to(other))
    _expect(errors, "assign", ModelConversionError, lambda: model.load_state_dict(plain.state_dict(), assign=True))
    _expect(errors, "replace", ModelConversionError, lambda: setattr(model.ln_f, "bias", nn.Parameter(torch.zeros(16))))
    # DDP over the model ZeroAdam trains would reduce its gradients a second time: refused before DDP starts.
    _expect(errors, "DDP", ModelConversionError, lambda: nn.parallel.DistributedDataParallel(model))
    out["DDP's attribute for others"] = hasattr(model, "_ddp_params_and_buffers_to_ignore")
    out["dtypes after errors"] = sorted({str(p.dtype) for p in model.parameters()})
    # model.state_dict(): saved with torch.save, loaded into the plain model.
    buf = io.BytesIO()
    if stage == 3:
        _expect(errors, "state_dict", ShardedParameterError, lambda: torch.save(model.state_dict(), io.BytesIO()))
        _expect(errors, "read", ShardedParameterError, lambda: model.blocks[1].fc.weight.sum())
        _expect(errors, "view", ShardedParameterError, lambda: model.blocks[1].fc.weight.t().contiguous())
        out["repr"] = repr(model.blocks[1].fc.weight)
        with opt.gathered_params():
            with torch.no_grad():
                model.blocks[1].fc.bias.fill_(0.25)  # written inside: kept
            torch.save(model.state_dict(), buf)
            kept = model.blocks[1].fc.weight.detach()  # a view that outlives the block
        out["view after the block"] = kept.float().clone()
    else:
        torch.save(model.state_dict(), buf)
    plain.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    out["saved"] = {k: v.float() for k, v in plain.state_dict().items()}
    out["whole"] = {k: v.float() for k, v in opt.full_state_dict().items()}
    # Still training after all of it.
    model_loss(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    return out


# --- the oracle: the plain model, torch.optim.AdamW, the global batch -----------------------------------


class _Oracle(_Side):
    """AdamW on one process; in bf16 the model converted and an fp32 master AdamW updates, copied back
    rounded after each step (tests/oracles.py's single_process_mixed), and taking what is written."""

    def __init__(self, model, precision: str, world: int):
        self.world, self.low = world, precision == "bf16"
        self.master = [nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
        if self.low:
            model.to(torch.bfloat16)
        self.opt = torch.optim.AdamW(self.master if self.low else model.parameters(), foreach=False, **HYPER)

    def backward(self, model, step: int) -> None:
        params = list(model.parameters())
        total = None
        for r in range(self.world):
            grads = torch.autograd.grad(model_loss(model, *rank_batch(model, step, r)), params)
            grads = [g.float() for g in grads]  # summed in fp32, as reduce_dtype=torch.float32 reduces
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
        for p, m, t in zip(params, self.master, total):
            (m if self.low else p).grad = (t / self.world).to(m.dtype)

    def grads(self, model) -> list[torch.Tensor]:
        return self.master if self.low else list(model.parameters())

    def step(self, model) -> None:
        self.opt.step()
        self.opt.zero_grad()
        if self.low:
            with torch.no_grad():
                for p, m in zip(model.parameters(), self.master):
                    p.copy_(m)

    def written(self, model) -> None:
        if self.low:
            with torch.no_grad():
                for p, m in zip(model.parameters(), self.master):
                    m.copy_(torch.where(p != m.to(p.dtype), p.float(), m))

    def whole(self, model) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _oracle(precision: str) -> tuple[dict, dict[str, torch.Tensor]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank runs: the same matmul blocking
    try:
        model = make_gpt("tiny")
        side = _Oracle(model, precision, WORLD)
        out = _script(model, side, precision)
        names = [n for n, _ in model.named_parameters()]
        return out, {n: m.detach().clone() for n, m in zip(names, side.master)}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_torch_calls_on_the_model_match_the_plain_model(stage, precision):
    results = run_ranks(_zero_rank, WORLD, args=(stage, precision), timeout=240)
    expected, master = _oracle(precision)
    dtype = DTYPES[precision]
    shapes = {n: tuple(p.shape) for n, p in make_gpt("tiny").named_parameters()}
    numel = sum(math.prod(s) for s in shapes.values())
    where = f"stage {stage} {precision}"
    for rank, out in enumerate(results):
        at = f"{where} rank {rank}"
        assert out["metadata equal"], f"{at}: parameter names, shapes, dtypes, devices differ from the plain model's"
        # The writes are elementwise, from the same generator state: exactly the plain model's values.
        assert max_abs_diff(out["after writes"], expected["after writes"]) == 0, f"{at}: writes"
        # torch.nn.utils.clip_grad_norm_ returns the global norm (a per-rank one, or 0.0, fails here).
        rel = norm_rel_tol(numel) if precision == "fp32" else ULP_REL[dtype]
        for step, (got, want) in enumerate(zip(out["norms"], expected["norms"])):
            assert math.isclose(got, want, rel_tol=rel), f"{at} step {step}: norm {got} != torch's {want}"
        # After load_state_dict the model holds the loaded values (in bf16 rounded), and trains from them.
        assert max_abs_diff(out["after load"], expected["after load"]) == 0, f"{at}: load_state_dict"
        if precision == "fp32":
            tol = fp32_tol(STEPS)
            assert max_abs_diff(out["final"], expected["final"]) <= tol, f"{at}: final parameters"
        else:
            tol = lp_param_tol(dtype, STEPS, expected["final"])
            assert max_abs_diff(out["final"], expected["final"]) <= tol, f"{at}: final parameters"
        # What torch.save wrote loads into the plain model: the whole parameters (buffers too).
        assert max_abs_diff(out["saved"], out["whole"]) == 0, f"{at}: saved state_dict"
        errors = out["errors"]
        for key in ("double", "half or float", "assign", "replace", "DDP"):
            assert errors[key].startswith("ModelConversionError"), f"{at}: {key}: {errors[key]}"
        assert "DistributedDataParallel cannot wrap" in errors["DDP"] and "ZeroAccelerator" in errors["DDP"]
        assert out["DDP's attribute for others"] is False, at
        assert "mixed_precision=" in errors["double"] and "ZeroAdam(stage=" in errors["double"]
        assert out["dtypes after errors"] == [str(dtype)], f"{at}: a refused conversion changed the model"
        assert errors["grad read"].startswith("ShardedGradientError") and "clip_grad_norm_" in errors["grad read"]
        assert "between backward and step()" in errors["model.zero_grad() before step"]
        if stage == 3:
            for key in ("state_dict", "read", "view"):
                assert errors[key].startswith("ShardedParameterError"), f"{at}: {key}: {errors[key]}"
            assert "opt.full_state_dict()" in errors["state_dict"] and "zerofast.checkpoint" in errors["state_dict"]
            assert "opt.gathered_params()" in errors["read"]
            assert "gathered_params()" in out["repr"] and "blocks.1.fc.weight" in out["repr"]
            # A view taken inside gathered_params() keeps its values after the block; a write is kept.
            assert torch.equal(out["view after the block"], out["whole"]["blocks.1.fc.weight"])
            assert torch.equal(out["whole"]["blocks.1.fc.bias"], torch.full((64,), 0.25))
    if precision == "bf16":  # the fp32 master followed every write
        got = full_master([out["master"] for out in results], shapes)
        assert max_abs_diff(got, master) <= low_precision_tol(dtype, STEPS), f"{where}: fp32 master"


# --- the master's other homes and update rules: a write after building = the same write before ---------
# Values exactly representable in bf16 (so the fp32 model written before building holds what the bf16
# model written after it does): the two runs are then the same run, bitwise, whatever follows the write.
WRITE_STEPS = 3


def _write(model) -> None:
    with torch.no_grad():
        nn.init.constant_(model.blocks[0].ln1.weight, 0.5)
        model.blocks[1].fc.weight.data.mul_(0.0).add_(0.125)  # through .data, as Hugging Face's inits write
        model.wte.weight[3].fill_(-0.25)  # one row: __setitem__ of a view-free index write


def _write_configs(tmp: str) -> dict[str, dict]:
    from zerofast import MixedPrecisionPolicy, OffloadPolicy

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return {
        "stage 1 bf16, state on the host": dict(stage=1, mixed_precision=bf16, offload="host"),
        "stage 2 fp32, state on disk": dict(stage=2, offload=f"disk:{tmp}/a"),
        "stage 2 bf16, 8-bit state": dict(
            stage=2, mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16, state_bits=8)
        ),
        "stage 2 bf16, delayed update": dict(
            stage=2, mixed_precision=bf16, offload=OffloadPolicy(state="host", delayed_update=True)
        ),
        "stage 3 bf16, state on disk": dict(stage=3, mixed_precision=bf16, offload=f"disk:{tmp}/b"),
        "stage 3 fp32": dict(stage=3),
        "ZeroMuon stage 1 bf16": dict(stage=1, mixed_precision=bf16, muon=True),
        "ZeroMuon stage 3 bf16": dict(stage=3, mixed_precision=bf16, muon=True),
    }


def _run_written(rank: int, kw: dict, after: bool) -> tuple[dict, list]:
    from zerofast import ZeroAdam, ZeroMuon

    kw = dict(kw)
    model = make_gpt("tiny")
    if not after:
        _write(model)
    opt = ZeroMuon(model, lr=1e-3, **kw) if kw.pop("muon", False) else ZeroAdam(model, **HYPER, **kw)
    if after:
        _write(model)
    for step in range(WRITE_STEPS):
        model_loss(model, *rank_batch(model, step, rank)).backward()
        opt.step()
        opt.zero_grad()
    opt.flush()
    state = ([(n, o, v.clone()) for n, o, v in opt.checkpoint_view.trainable.state_pieces("master")],)
    return opt.full_state_dict(), state


def _delayed_write_wins(rank: int, kw: dict) -> bool:
    """With the delayed update in flight, a write made meanwhile wins over it: after flush() the model
    holds the written value and the fp32 master is its value."""
    from zerofast import ZeroAdam

    model = make_gpt("tiny")
    opt = ZeroAdam(model, **HYPER, **kw)
    model_loss(model, *rank_batch(model, 0, rank)).backward()
    opt.step()  # its update runs on a thread now
    with torch.no_grad():
        model.ln_f.weight.fill_(0.75)
    opt.flush()
    master = {n: v for n, _, v in opt.checkpoint_view.trainable.state_pieces("master")}
    whole = opt.full_state_dict()["ln_f.weight"]
    return bool((whole == 0.75).all()) and all(bool((v == 0.75).all()) for n, v in master.items() if n == "ln_f.weight")


def _written_after_and_before(rank, world):
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in _write_configs(tmp).items():
            out[name] = (_run_written(rank, kw, after=True), _run_written(rank, kw, after=False))
        out["delayed write wins"] = _delayed_write_wins(rank, _write_configs(tmp)["stage 2 bf16, delayed update"])
    return out


def test_a_write_after_building_is_the_same_write_before_it():
    """Offloaded state (host, disk), 8-bit moments, the delayed update, stage 3, ZeroMuon: the master
    follows what is written into the model after the optimizer is built, as if written before."""
    for rank, out in enumerate(run_ranks(_written_after_and_before, WORLD, timeout=300)):
        assert out.pop("delayed write wins"), f"rank {rank}: a write during the delayed update was undone"
        for name, ((whole_a, master_a), (whole_b, master_b)) in out.items():
            assert whole_a.keys() == whole_b.keys()
            for k in whole_a:
                assert torch.equal(whole_a[k], whole_b[k]), f"rank {rank} {name}: {k} differs"
            for (n, o, a), (_, _, b) in zip(master_a[0], master_b[0]):
                assert torch.equal(a, b), f"rank {rank} {name}: master of {n} at {o} differs"


# --- a model not our own, and the calls that stay errors ---------------------------------------------


def _hf_init_and_more(rank, world, stage):
    """A Hugging Face Llama (from its config, a padding row in its embedding, tied head) initialized by
    its own _init_weights after ZeroAdam was built (transformers' init.normal_, init.zeros_ of
    weight[padding_idx]): the plain model's values, bitwise. Then what stays an error at this stage."""
    import copy

    from models import tiny_llama

    from zerofast import ZeroAdam
    from zerofast.errors import ModelConversionError, ShardedParameterError

    model, plain = (
        tiny_llama(pad_token_id=0, tie_word_embeddings=True),
        tiny_llama(pad_token_id=0, tie_word_embeddings=True),
    )
    opt = ZeroAdam(model, stage=stage, **HYPER)
    for m in (model, plain):
        torch.manual_seed(3)
        m.apply(m._init_weights)
    out = {"init": {k: v.float() for k, v in opt.full_state_dict().items()}}
    out["plain"] = {k: v.detach().float().clone() for k, v in plain.state_dict().items()}
    out["num_parameters"] = (model.num_parameters(), plain.num_parameters())
    errors = out["errors"] = {}
    weight = model.model.layers[0].mlp.up_proj.weight
    if stage == 3:
        _expect(errors, "t_", ShardedParameterError, lambda: weight.t_())
        _expect(errors, "deepcopy", ShardedParameterError, lambda: copy.deepcopy(model))
        with torch.no_grad():
            weight[1] = 0.5  # __setitem__ on the released parameter: kept
        out["row"] = opt.full_state_dict()["model.layers.0.mlp.up_proj.weight"][1]
    else:  # new storage for a parameter: the next step refuses it on every rank, nothing applied
        with torch.no_grad():
            weight.data = torch.zeros_like(weight)
        x = torch.randint(1, 32, (2, 6))
        model(input_ids=x, labels=x).loss.backward()
        _expect(errors, "rebound", ModelConversionError, opt.step)
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_a_hugging_face_models_own_init_after_building_and_what_stays_an_error(stage):
    for out in run_ranks(_hf_init_and_more, WORLD, args=(stage,), timeout=180):
        assert max_abs_diff(out["init"], out["plain"]) == 0
        assert out["num_parameters"][0] == out["num_parameters"][1]
        errors = out["errors"]
        if stage == 3:
            assert errors["t_"].startswith("ShardedParameterError") and "gathered_params()" in errors["t_"]
            assert errors["deepcopy"].startswith("ShardedParameterError")
            assert torch.equal(out["row"], torch.full((32,), 0.5))
        else:
            assert errors["rebound"].startswith("ModelConversionError")
            assert "model.layers.0.mlp.up_proj.weight no longer views the optimizer's buffer" in errors["rebound"]


def _frozen_model_calls(rank, world):
    """A reference model sharded for inference only (shard_frozen), then given new weights the way a
    user loads them (load_state_dict of whole tensors, strict as torch's): its forward equals the
    plain model's with those weights; its values read outside a forward are a named error."""
    from models import tiny_llama

    from zerofast import shard_frozen
    from zerofast.errors import ShardedParameterError

    model, plain = tiny_llama(), tiny_llama()
    shard_frozen(model)
    new = _new_values(plain)
    plain.load_state_dict(new)
    missing = model.load_state_dict({k: v for k, v in new.items() if "norm" not in k}, strict=False)
    model.load_state_dict(new)
    x = torch.randint(1, 32, (2, 6))
    with torch.no_grad():
        equal = torch.equal(model(input_ids=x).logits, plain(input_ids=x).logits)
    try:
        model.model.norm.weight.max()
        error = None
    except ShardedParameterError as e:
        error = str(e)
    try:
        model.load_state_dict({"model.norm.weight": new["model.norm.weight"]})  # strict: the rest is missing
        strict = None
    except RuntimeError as e:
        strict = str(e)
    return equal, sorted(missing.missing_keys), error, strict


def test_a_model_sharded_for_inference_loads_new_weights():
    for equal, missing, error, strict in run_ranks(_frozen_model_calls, WORLD, timeout=120):
        assert equal
        assert missing and all("norm" in k for k in missing)
        assert error is not None and "shard_frozen" in error and "gathered_params()" in error
        assert strict is not None and "Missing key(s) in state_dict" in strict


def test_same_device_says_whether_a_move_moves():
    from zerofast.guard.params import same_device

    assert same_device(torch.device("cpu:0"), torch.device("cpu"))
    assert not same_device(torch.device("cuda:0"), torch.device("cpu"))
    assert same_device(torch.device("cuda:1"), torch.device("cuda:1"))
    assert not same_device(torch.device("cuda:1"), torch.device("cuda:0"))


def _compiled_and_profiled(rank, world):
    """What we add under torch.compile and the profiler: a compiled read of a released stage-3
    parameter raises the eager named error (metadata compiles); torch's clip_grad_norm_ under the
    profiler gives the eager norm."""
    from zerofast import ZeroAdam
    from zerofast.errors import ShardedParameterError

    model = make_gpt("tiny")
    opt = ZeroAdam(model, stage=3, **HYPER)
    out = {"shape": torch.compile(lambda: model.ln_f.weight.shape[0] * 2)()}
    try:
        torch.compile(lambda: model.ln_f.weight.sum())()
        out["read"] = "no error"
    except ShardedParameterError as e:
        out["read"] = str(e)
    model_loss(model, *rank_batch(model, 0, rank)).backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        out["profiled norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))
    out["norm"] = float(opt.clip_grad_norm_(math.inf))
    opt.step()
    return out


def test_under_torch_compile_and_the_profiler():
    for out in run_ranks(_compiled_and_profiled, WORLD, timeout=180):
        assert out["shape"] == 32
        assert "ln_f.weight was read (sum())" in out["read"] and "gathered_params()" in out["read"]
        # The same reduced gradient: the sums differ only in order (per tensor, then over tensors).
        numel = sum(p.numel() for p in make_gpt("tiny").parameters())
        assert math.isclose(out["profiled norm"], out["norm"], rel_tol=norm_rel_tol(numel))
