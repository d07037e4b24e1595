"""Shared pieces of the multi-rank tests: the data each rank sees, and the single-process oracle."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerofast.tools.models import make_gpt, random_batch

# lr 1e-3: Adam's first steps move each element by about lr * sign(g), so an element whose true
# gradient is ~0 (pure rounding noise, whose sign depends on summation order) moves by up to lr in a
# direction no two reduction orders agree on; at lr 1e-2 that alone reached 1.6e-5 on 3 ranks.
# eps 1e-6 for the same reason: an element whose gradient is near eps (an embedding row of a token
# absent from the batch, ~1e-9) is updated by lr * g / (|g| + eps), whose relative error is that of
# g itself; with eps 1e-8 and 4 ranks that reached 2.07e-5 (the engine and the reference stage
# agreed bitwise there; only the single-process summation order differed).
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
LOCAL_BATCH = 2


# --- Tolerances: why each number is what it is ------------------------------------------------------
# Two correct runs differ only by rounding: the order in which N rank gradients are added (gloo's
# ring against one process's sum), a norm summed per shard against torch's per tensor, and matmul
# blocking, which differs between processors (oneDNN/AMX on Intel Sapphire Rapids, AVX2 on AMD
# EPYC: the same test rounds differently there). So no tolerance is a number that happened to pass
# on one machine; each is a bound in units of the compared quantity's own precision:
#
# fp32_tol(steps): 16 ulps of the parameters' scale (1.0: layer norm weights; the largest in
#   every model here) per step. Per step, the reduced gradients differ by the rounding of a sum of
#   N <= 4 terms (<= N ulps relative); Adam's step lr * m^/(sqrt(v^) + eps) is scale-free, so a
#   relative error carries through m^ and through sqrt(v^) (x2), and both runs round (x2):
#   2 * 2 * N = 16 ulps of the parameter per step at most, for elements whose gradient is well above
#   eps. An element whose true gradient is near zero has no relative precision at all; eps = 1e-6
#   keeps its step at lr * g / eps, of the size of the rounding of g itself (see HYPER above).
# low_precision_tol(dtype, steps): bf16/fp16 parameters round the fp32 master; a last-bit
#   difference upstream can round one of them to its neighbour, and every later gradient then
#   differs by up to one ulp relative of that dtype (fp16 2^-10, bf16 2^-7). Adam carries a
#   relative gradient change into the step at most twice over (through m^ and sqrt(v^)):
#   2 * steps * lr * ulp of the fp32 master.
# lp_param_tol(dtype, steps, params): that master drift, plus one ulp of the dtype at the largest
#   parameter's magnitude (the two masters may round to neighbouring values).
# norm_rel_tol(numel): a sum of numel squares in another order differs by at most numel * 2^-24
#   relative (the classic worst-case bound gamma_n for float32).
ULP_REL = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def fp32_tol(steps: int, scale: float = 1.0) -> float:
    return steps * 16 * ulp(torch.float32, scale)


def low_precision_tol(dtype: torch.dtype, steps: int) -> float:
    return 2 * steps * HYPER["lr"] * ULP_REL[dtype]


def lp_param_tol(dtype: torch.dtype, steps: int, params: dict[str, torch.Tensor]) -> float:
    largest = max(p.abs().max().item() for p in params.values())
    return low_precision_tol(dtype, steps) + ulp(dtype, largest)


def norm_rel_tol(numel: int) -> float:
    return numel * 2.0**-24


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    """The spacing of `dtype`'s values at `magnitude` (its unit in the last place there)."""
    import math

    exponent = math.floor(math.log2(magnitude)) if magnitude > 0 else 0
    return 2.0**exponent * ULP_REL[dtype]


def rank_batch(model, step: int, rank: int):
    """Rank `rank`'s batch at `step`: the same on every run, different on every rank."""
    cfg = model.cfg
    return random_batch(cfg, LOCAL_BATCH, cfg.block_size, seed=1000 * step + rank)


def global_batch(model, step: int, world: int):
    parts = [rank_batch(model, step, r) for r in range(world)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def train_steps(
    model, opt, rank: int, steps: int, *, start: int = 0, forward=None, backward=None, before_step=None, after_step=None
) -> list[float]:
    """The multi-rank tests' training loop, written once. For each step in range(start, start +
    steps): rank `rank`'s batch (rank_batch, moved to the model's device), its loss, backward,
    opt.step(), opt.zero_grad(). What a test does in between goes in the hooks:
    - forward(model, x, y, step) -> loss; default model_loss (our GPT-shaped models, a Hugging Face LM);
    - backward(loss); default loss.backward() (pass opt.backward for fp16's loss scaling);
    - before_step(step): after backward, before opt.step() (clip_grad_norm_, a snapshot);
    - after_step(step): after opt.step(), before opt.zero_grad() (memory while the step's state
      exists, an LR scheduler).
    Returns each step's loss."""
    device = next(model.parameters()).device
    losses = []
    for step in range(start, start + steps):
        x, y = (t.to(device) for t in rank_batch(model, step, rank))
        loss = forward(model, x, y, step) if forward is not None else model_loss(model, x, y)
        if backward is not None:
            backward(loss)
        else:
            loss.backward()
        if before_step is not None:
            before_step(step)
        opt.step()
        if after_step is not None:
            after_step(step)
        opt.zero_grad()
        losses.append(loss.item())
    return losses


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


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"parameter names differ: {sorted(a.keys() ^ b.keys())}"
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


class Quirky(torch.nn.Module):
    """The tiny GPT (tied embeddings) plus the awkward cases: a frozen parameter, a parameter used
    only in even steps (on every rank), and one used only on rank 0 (odd numel, 7)."""

    def __init__(self):
        super().__init__()
        self.gpt = make_gpt("tiny")
        g = torch.Generator().manual_seed(1)
        self.frozen = torch.nn.Parameter(torch.randn(5, generator=g), requires_grad=False)
        self.sometimes = torch.nn.Linear(16, 16)
        self.rank0_only = torch.nn.Parameter(torch.randn(7, generator=g))
        self.register_buffer("probe", torch.randn(4, 16, generator=g))
        self.cfg = self.gpt.cfg

    def forward(self, x, y, step: int, rank: int) -> torch.Tensor:
        """The loss (the root's forward uses `rank0_only` and `frozen` itself)."""
        _, loss = self.gpt(x, y)
        loss = loss + 1e-2 * self.frozen.sum()
        if step % 2 == 0:
            loss = loss + 0.1 * self.sometimes(self.probe).pow(2).mean()
        if rank == 0:
            loss = loss + 0.1 * self.rank0_only.pow(2).sum()
        return loss


def two_groups(model: torch.nn.Module) -> list[dict]:
    """Matrices in one group, vectors (biases, norms, rank0_only) in another with its own lr and wd."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in trainable if p.dim() >= 2], "lr": 1e-3, "weight_decay": 0.1},
        {"params": [p for p in trainable if p.dim() < 2], "lr": 2e-3, "weight_decay": 0.0},
    ]


def make_scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


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


class TwiceMLP(torch.nn.Module):
    """No tied weights (so stage 3 moves exactly 3Φ), one block called twice per forward, and an
    odd-sized head: embedding -> block -> block (again) -> head."""

    def __init__(self, vocab=37, width=24):
        super().__init__()
        torch.manual_seed(2)
        self.emb = torch.nn.Embedding(vocab, width)
        self.block = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.LayerNorm(width))
        self.head = torch.nn.Linear(width, vocab)
        self.cfg = type("Cfg", (), {"vocab_size": vocab, "block_size": 8})()

    def forward(self, x, y):
        h = self.emb(x)
        h = self.block(h)
        h = self.block(h)  # the same module twice
        return None, torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


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


def full_master(per_rank_pieces: list[list[tuple]], shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Assemble the fp32 master from each rank's pieces [(name, offset into the flat parameter, values)]."""
    out = {n: torch.full((int(torch.tensor(s).prod().item()) if s else 1,), float("nan")) for n, s in shapes.items()}
    for pieces in per_rank_pieces:
        for name, offset, values in pieces:
            out[name][offset : offset + values.numel()] = values
    return {n: t.view(shapes[n]) for n, t in out.items()}


class Nested(torch.nn.Module):
    """A model shaped like most real ones, unlike our GPT: the blocks three levels down
    (`backbone.layers[i]`), the token embedding inside the backbone tied to an output head at the
    root, and a final norm between them. forward(x, y) -> (logits, loss), as the GPT's."""

    def __init__(self, vocab=48, width=16, layers=3, block_size=12):
        super().__init__()
        torch.manual_seed(3)
        self.cfg = type("Cfg", (), {"vocab_size": vocab, "block_size": block_size})()
        self.backbone = torch.nn.Module()
        self.backbone.embed = torch.nn.Embedding(vocab, width)
        self.backbone.layers = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(width),
                torch.nn.Linear(width, 2 * width),
                torch.nn.GELU(),
                torch.nn.Linear(2 * width, width),
            )
            for _ in range(layers)
        )
        self.backbone.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.backbone.embed.weight  # tied: used first and last

    def forward(self, x, y):
        h = self.backbone.embed(x)
        for layer in self.backbone.layers:
            h = h + layer(h)
        logits = self.head(self.backbone.norm(h))
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def hf_gpt2(layers: int = 3):
    """A randomly initialised Hugging Face GPT-2 from a config (no download), dropout off so that
    runs are deterministic; forward(x, y) as our GPT's through `hf_loss`. None without transformers."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    torch.manual_seed(4)
    cfg = GPT2Config(
        n_layer=layers,
        n_embd=16,
        n_head=2,
        vocab_size=48,
        n_positions=12,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg)
    model.cfg = type("Cfg", (), {"vocab_size": 48, "block_size": 12})()
    return model


def model_loss(model, x, y) -> torch.Tensor:
    """The loss of our GPT-shaped models (forward(x, y) -> (_, loss)) and of a Hugging Face causal LM."""
    if hasattr(model, "config") and hasattr(model.config, "model_type"):
        return model(input_ids=x, labels=x).loss
    return model(x, y)[1]


def opcheck_adam_op(op, args, n: int, device, **kw) -> None:
    """torch.library.opcheck of a fused Adam op (fused_adam_, fused_adam_8bit_) twice, on fresh
    tensors from args() each time: its optional tensors absent, then present (found_inf, an fp16
    param_copy, a grad_scale tensor); kw: the op's own keyword arguments and overrides."""
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1, adamw=True, grad_scale=1.0) | kw
    kw.update(grad_scale_tensor=None, found_inf=None, param_copy=None)
    torch.library.opcheck(op, args(), kw)
    kw.update(
        found_inf=torch.zeros(1, device=device),
        param_copy=torch.empty(n, device=device).half(),
        grad_scale_tensor=torch.ones(1, device=device),
    )
    torch.library.opcheck(op, args(), kw)


def train_same_batch(model, opt, start: int, steps: int) -> None:
    """Steps start .. start + steps - 1 with the same batch on every rank (rank 0's), so the averaged
    gradient is exact and runs at any world size can be compared bitwise."""
    for step in range(start, start + steps):
        x, y = rank_batch(model, step, 0)
        model_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()


def layout_of(opt):
    """The optimizer's layout of its trainable parameters, as its checkpoint view gives it."""
    return opt.checkpoint_view.trainable.layout


def param_bytes(opt) -> int:
    """Parameter storage that exists now (stage 3: shards and the units gathered at the moment)."""
    return opt.report().memory.materialized_params


WORDS = "the a cat dog sat ran on under mat log red blue big small".split()


def word_tokenizer():
    """A Hugging Face fast tokenizer over WORDS (one token a word, <pad> <unk> <s> </s> first):
    built in memory, no download; what the TRL launches tokenize their text with."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<s>", "</s>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def tiny_llama(**config):
    """A 2-layer Hugging Face Llama over WORDS' 32-token vocabulary (width 32), built from its config
    with seed 0: random weights, no download. `config`: more LlamaConfig fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
            **config,
        )
    )


def gathered_bytes(opt) -> int:
    """Bytes of stage 3's unit buffers that exist now (the shards not counted)."""
    from zerofast.optim.zero_adam import parts_of

    return sum(b.untyped_storage().nbytes() for part in parts_of(opt).units.buffers.parts for b in part.buffers)


def unit_bytes(opt) -> list[int]:
    """Each stage-3 unit's gathered size in bytes (its trainable and frozen buckets)."""
    from zerofast.optim.zero_adam import parts_of

    parts = parts_of(opt).units.buffers.parts
    return [
        sum(
            p.buffers[p.bucket_of[u]].numel() * p.buffers[p.bucket_of[u]].element_size()
            for p in parts
            if p.bucket_of[u] is not None
        )
        for u in range(len(parts_of(opt).units.state))
    ]


def held_tensor_bytes(root) -> int:
    """Bytes of every distinct tensor storage the optimizer holds from Python: a walk through its
    attributes, containers and the objects they hold, stopping at the model (whose parameters are
    views of the optimizer's own buffers) and at process groups. Independent of report()."""
    import torch.nn as nn

    seen, storages, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (nn.Module, dist.ProcessGroup, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return sum(n for ptr, n in storages.items() if ptr)


def zero_options(
    stage: int,
    *,
    partition=None,
    bucket_mb=None,
    bucket_buffers=None,
    overlap=None,
    overlap_param_gather=None,
    accumulate_locally=None,
    check_collectives=None,
    shard_size=None,
    min_unit_mb=None,
    units=None,
    mixed_precision=None,
    reduce_dtype=None,
    init_scale=None,
    growth_interval=None,
) -> dict:
    """ZeroAdam's keywords for a test matrix written over flat option names: the stage, and the
    policies that hold the options given (None: the policy's default). A bucket size belongs to
    stages 1 and 2, so a matrix over stages passes bucket_mb to those only (stage 3 reduces one
    bucket per unit, and ZeroAdam rejects a bucket size there)."""
    from zerofast import CommPolicy, LossScalePolicy, MixedPrecisionPolicy, UnitPolicy

    comm = {
        k: v
        for k, v in dict(
            partition=partition,
            bucket_mb=bucket_mb if stage < 3 else None,
            bucket_buffers=bucket_buffers,
            overlap=overlap,
            overlap_param_gather=overlap_param_gather,
            accumulate_locally=accumulate_locally,
            check_collectives=check_collectives,
            shard_size=shard_size,
        ).items()
        if v is not None
    }
    out = dict(stage=stage, comm=CommPolicy(**comm))
    if stage == 3 and (units is not None or min_unit_mb is not None):
        out["units"] = UnitPolicy(modules=units, min_unit_mb=min_unit_mb if units is None else None)
    scaling = {k: v for k, v in dict(init_scale=init_scale, growth_interval=growth_interval).items() if v is not None}
    if mixed_precision is not None and (reduce_dtype is not None or scaling):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[mixed_precision]
        out["mixed_precision"] = MixedPrecisionPolicy(
            dtype, reduce_dtype, LossScalePolicy(**scaling) if scaling else None
        )
    elif mixed_precision is not None:
        out["mixed_precision"] = mixed_precision
    return out
