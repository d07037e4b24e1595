"""Training quality of 8-bit Adam state: the final loss of ZeroAdam with MixedPrecisionPolicy(state_bits=8)
against the spread of three seeds of 32-bit state, with torchao's and bitsandbytes' AdamW8bit (plain
PyTorch, the libraries' defaults) on the same model and batches as anchors.

- "gpt": the bench GPT (zerofast.tools.models, 4 layers x 128 wide, 0.83M parameters, tied
  embeddings) on the main job's shipped text (zerofast.tools.data), batch 8 x 64 byte tokens, 300
  steps, lr 1e-3, weight decay 0.1, no schedule (the main job's lr, 3e-3, stalls this model on
  the unigram plateau, loss ~2.9, for some seeds and not others: a spread that says nothing).
- "hf": a GPT-2 built by transformers from its config (2 layers x 64 wide, random weights, no
  download; dropout off) on the same text and batches, 300 steps; zerofast only.
- "hf-finetune": a fine-tune. No pretrained weights can be downloaded, so a transformers GPT-2
  (4 layers x 128 wide, 0.83M parameters, tied embeddings, dropout off) is first pretrained here,
  once per session (the `pretrained` fixture, a file under pytest's tmp dir): 1000 steps of plain
  torch.optim.AdamW (lr 1e-3, weight decay 0.1, batch 16 x 64, seed 0, one thread) on the
  docstrings of 46 standard-library modules and of their public functions and classes (DOC_MODULES;
  about 188 KB on Python 3.11, fixed by the Python version; the summary prints the version, size,
  hash and losses). Every run then fine-tunes those same weights on the shipped text, 300 steps at
  lr 3e-4 (a third of the pretraining lr), with zerofast 32- and 8-bit state and both anchors;
  the seed draws only the order of the batches.

The GPT also runs 8-bit state with state_block=64 (three seeds): whether a smaller block (finer
scales, 4 bytes more per 64 elements) moves the final loss on this model.

Each run is one process (a world of 1 on gloo, one thread: how 8-bit state rounds does not depend on
the world size, stage or partition; the state is bitwise the same at any of them), stage 1. Seed s
draws the initial weights (but for the fine-tune) and the order of the batches. The final loss is
the mean training loss of the last 20 steps; the summary puts each run beside the 32-bit seeds'
range and says whether the 8-bit runs fall inside it. The benchmark's own time is the whole run (300 steps; torchao's includes
compiling its step).

    pytest benchmarks/bench_quality.py --benchmark-only
    pytest benchmarks/bench_quality.py --benchmark-only -k finetune -s   # the fine-tune alone
"""

from __future__ import annotations

import functools
import hashlib
import math
import statistics
import time
from collections import Counter

import pytest
from rankpool import RankPool

SEEDS = (0, 1, 2)
LAST = 20  # steps averaged into the final loss
HYPER = dict(lr=1e-3, weight_decay=0.1)
# A fine-tune steps a third of the pretraining lr (1e-3): it adapts the pretrained weights rather
# than training them anew, as fine-tunes of pretrained language models conventionally do.
FINETUNE_HYPER = dict(lr=3e-4, weight_decay=0.1)
BATCH, SEQ = 8, 64
SETTINGS = {
    "gpt": dict(steps=300, hyper=HYPER, label="bench GPT 4x128 (0.83M params), 300 steps"),
    "hf": dict(steps=300, hyper=HYPER, label="transformers GPT-2 2x64 from config (random weights), 300 steps"),
    "hf-finetune": dict(
        steps=300,
        hyper=FINETUNE_HYPER,
        label="transformers GPT-2 4x128 pretrained on stdlib docstrings, fine-tuned 300 steps at lr 3e-4",
    ),
}
# The pretraining text: the docstrings of these standard-library modules and of their public
# functions and classes (the Python version fixes the text; the summary prints it and a hash).
# English prose about programming, written by many authors, and nothing of the fine-tune's text.
DOC_MODULES = (
    "abc argparse base64 bisect calendar collections contextlib copy csv dataclasses datetime decimal difflib "
    "enum fractions functools glob gzip heapq html ipaddress itertools json math operator pathlib pickle "
    "pprint queue random re shlex shutil statistics string struct subprocess tarfile tempfile textwrap "
    "threading timeit unittest uuid warnings zipfile"
).split()
PRETRAIN = dict(steps=1000, batch=16, seed=0, lr=1e-3, weight_decay=0.1)  # plain torch.optim.AdamW
_RESULTS: dict[str, list[tuple[str, int, float]]] = {}
_TABLES: dict[str, list[str]] = {}  # each model's summary table, registered once, refilled after each run


def make_model(model: str, seed: int, init: str | None = None):
    """The model of a setting: seed draws its initial weights, except for "hf-finetune", which
    starts from the pretrained state_dict saved at `init` whatever the seed."""
    import torch

    if model == "gpt":
        from zerofast.tools.models import make_gpt

        return make_gpt("small", seed=seed, n_layer=4, n_embd=128, n_head=4)
    if model == "hf-finetune":
        net = finetune_gpt2(seed)
        net.load_state_dict(torch.load(init, weights_only=True))
        return net
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def finetune_gpt2(seed: int):
    """The fine-tune's GPT-2, 4 layers x 128 wide (0.83M parameters), random weights from seed."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg = GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=128, n_layer=4, n_head=4, **no_dropout)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def docstring_corpus() -> bytes:
    """The docstrings of DOC_MODULES and of their public functions and classes (those in __all__,
    or every name without a leading underscore), each text once, in a fixed order."""
    import importlib
    import inspect

    seen, texts = set(), []
    for name in DOC_MODULES:
        module = importlib.import_module(name)
        public = sorted(getattr(module, "__all__", None) or (a for a in dir(module) if not a.startswith("_")))
        members = [getattr(module, a) for a in public if hasattr(module, a)]
        for obj in [module] + [m for m in members if inspect.isclass(m) or inspect.isroutine(m)]:
            doc = inspect.getdoc(obj)
            if doc and doc not in seen:
                seen.add(doc)
                texts.append(doc)
    return "\n\n".join(texts).encode("utf-8")


def unigram_entropy(data: bytes) -> float:
    """The loss (nats per byte) of the best model that ignores context: the unigram plateau."""
    counts = Counter(data)
    return -sum(c / len(data) * math.log(c / len(data)) for c in counts.values())


def build_pretrain(path, rank, world):
    """One step that pretrains the fine-tune's GPT-2 with plain torch.optim.AdamW on the docstring
    corpus and saves its state_dict at path; info() reports the losses and the corpus."""
    import sys

    import torch
    import torch.nn.functional as F

    from zerofast.tools.data import corpus_tokens, text_batch

    corpus = docstring_corpus()
    tokens = torch.tensor(list(corpus), dtype=torch.long)
    model = finetune_gpt2(PRETRAIN["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=PRETRAIN["lr"], weight_decay=PRETRAIN["weight_decay"])
    report = dict(python=sys.version.split()[0], corpus_bytes=len(corpus), unigram=unigram_entropy(corpus))
    report["sha256"] = hashlib.sha256(corpus).hexdigest()[:16]
    report["finetune_unigram"] = unigram_entropy(bytes(corpus_tokens().tolist()))

    def loss_of(x, y):
        logits = model(x).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    @torch.no_grad()
    def finetune_text_loss():  # on the fine-tune's text, batches no fine-tune run draws
        zero = corpus_tokens()
        return statistics.fmean(loss_of(*text_batch(zero, BATCH, SEQ, seed=20_000_000 + i)).item() for i in range(8))

    def pretrain():
        report["finetune_text_before"] = finetune_text_loss()
        start, losses = time.perf_counter(), []
        for i in range(PRETRAIN["steps"]):
            loss = loss_of(*text_batch(tokens, PRETRAIN["batch"], SEQ, seed=10_000_000 + i))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        report.update(seconds=time.perf_counter() - start, first=losses[0], final=statistics.fmean(losses[-LAST:]))
        report["finetune_text_after"] = finetune_text_loss()
        torch.save(model.state_dict(), path)

    pretrain.info = lambda: report
    return pretrain


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory):
    """The pretrained GPT-2's state_dict (a file, written once per session; one process, one
    thread, fixed seeds: the same weights every time) and the lines that describe its pretraining."""
    path = str(tmp_path_factory.mktemp("pretrained") / "gpt2-docstrings.pt")
    pool = RankPool(functools.partial(build_pretrain, path), world=1, timeout=1800)
    try:
        pool.step()
        r = pool.info()[0]
    finally:
        pool.close()
    lines = [
        f"corpus: docstrings of {len(DOC_MODULES)} standard-library modules, Python {r['python']}, "
        f"{r['corpus_bytes']} bytes (sha256 {r['sha256']}), unigram entropy {r['unigram']:.3f} nats/byte",
        f"{PRETRAIN['steps']} steps of torch.optim.AdamW (lr {PRETRAIN['lr']}, weight decay "
        f"{PRETRAIN['weight_decay']}), batch {PRETRAIN['batch']} x {SEQ}, {r['seconds']:.0f} s",
        f"training loss {r['first']:.3f} (step 1) -> {r['final']:.4f} (mean of the last {LAST} steps)",
        f"loss on the fine-tune text (8 batches of {BATCH} x {SEQ}): random weights "
        f"{r['finetune_text_before']:.3f}, pretrained {r['finetune_text_after']:.3f} "
        f"(its unigram entropy {r['finetune_unigram']:.3f})",
    ]
    print("\npretraining: " + "\npretraining: ".join(lines))
    return path, lines


def make_step(optimizer: str, model, hyper: dict):
    """A function of the loss that runs one optimizer step: ZeroAdam with 32- or 8-bit state, or
    an anchor's AdamW8bit on the plain model."""
    if optimizer.startswith("zerofast"):
        from zerofast import MixedPrecisionPolicy, ZeroAdam

        if "8-bit" in optimizer:  # "zerofast 8-bit" (the default block, 256) or "zerofast 8-bit, block B"
            block = int(optimizer.split("block ")[1]) if "block" in optimizer else MixedPrecisionPolicy.state_block
            policy = MixedPrecisionPolicy(state_bits=8, state_block=block)
        else:
            policy = MixedPrecisionPolicy(state_bits=32)
        opt = ZeroAdam(model, stage=1, mixed_precision=policy, **hyper)

        def zero_step(loss):
            opt.backward(loss)
            opt.step()
            opt.zero_grad()

        return zero_step
    if optimizer == "torchao AdamW8bit":
        from torchao.optim import AdamW8bit
    else:
        from bitsandbytes.optim import AdamW8bit
    opt = AdamW8bit(model.parameters(), **hyper)

    def anchor_step(loss):
        loss.backward()
        opt.step()
        opt.zero_grad()

    return anchor_step


def build(model_name, optimizer, seed, init, rank, world):
    import torch.nn.functional as F

    from zerofast.tools.data import corpus_tokens, text_batch

    model = make_model(model_name, seed, init)
    step = make_step(optimizer, model, SETTINGS[model_name]["hyper"])
    tokens = corpus_tokens()
    losses = []

    def train():
        for i in range(SETTINGS[model_name]["steps"]):
            x, y = text_batch(tokens, BATCH, SEQ, seed=100_000 * seed + i)
            out = model(x)
            logits = out[0] if isinstance(out, tuple) else out.logits
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            step(loss)
            losses.append(loss.item())

    train.info = lambda: losses
    return train


def run_case(benchmark, model_name, optimizer, seed, init=None):
    pool = RankPool(functools.partial(build, model_name, optimizer, seed, init), world=1, timeout=1800)
    try:
        benchmark.pedantic(pool.step, rounds=1, iterations=1)
        losses = pool.info()[0]
    finally:
        pool.close()
    final = statistics.fmean(losses[-LAST:])
    benchmark.extra_info.update(final_loss=final, first_loss=losses[0], steps=len(losses))
    _RESULTS.setdefault(model_name, []).append((optimizer, seed, final))
    print(f"\n{model_name} {optimizer} seed {seed}: loss {losses[0]:.3f} -> {final:.4f} (last {LAST} steps)")


CASES = [("gpt", "zerofast 32-bit", s) for s in SEEDS]
CASES += [("gpt", "zerofast 8-bit", s) for s in SEEDS]
CASES += [("gpt", "zerofast 8-bit, block 64", s) for s in SEEDS]
CASES += [("gpt", "torchao AdamW8bit", s) for s in SEEDS] + [("gpt", "bitsandbytes AdamW8bit", s) for s in SEEDS]
CASES += [("hf", "zerofast 32-bit", s) for s in SEEDS] + [("hf", "zerofast 8-bit", s) for s in SEEDS]
FINETUNE_OPTIMIZERS = ("zerofast 32-bit", "zerofast 8-bit", "torchao AdamW8bit", "bitsandbytes AdamW8bit")
CASES += [("hf-finetune", o, s) for o in FINETUNE_OPTIMIZERS for s in SEEDS]


@pytest.mark.parametrize(
    "model_name,optimizer,seed", CASES, ids=[f"{m}-{o.replace(',', '').replace(' ', '_')}-{s}" for m, o, s in CASES]
)
def test_final_loss(request, benchmark, record, record_not_run, record_ratios, model_name, optimizer, seed):
    if "AdamW8bit" in optimizer:
        pytest.importorskip(optimizer.split()[0])
    if model_name.startswith("hf"):
        pytest.importorskip("transformers")
    init = None
    if model_name == "hf-finetune":  # pretrained once per session, before the first fine-tune
        init, pretraining = request.getfixturevalue("pretrained")
    if model_name not in _TABLES:
        if model_name == "hf-finetune":
            record_ratios("pretraining of the fine-tune's GPT-2", pretraining)
        _TABLES[model_name] = []
        record_ratios(f"final loss, {SETTINGS[model_name]['label']}", _TABLES[model_name])
    try:
        run_case(benchmark, model_name, optimizer, seed, init)
    except RuntimeError as e:  # an anchor that cannot run here is reported with its error
        if "AdamW8bit" not in optimizer:
            raise
        record_not_run(SETTINGS[model_name]["label"], f"{optimizer} seed {seed}", str(e).splitlines()[-1][:200])
        return
    record(benchmark, SETTINGS[model_name]["label"], f"{optimizer} seed {seed}")
    _TABLES[model_name][:] = quality_table(model_name)


def quality_table(model_name: str) -> list[str]:
    """The runs of one model beside the 32-bit seeds' range (inside, or above it: a higher loss, or
    below it) and beside the 32-bit run of the same seed (same initial weights and batches)."""
    rows = _RESULTS.get(model_name, [])
    base = {seed: f for o, seed, f in rows if o == "zerofast 32-bit"}
    lo, hi = (min(base.values()), max(base.values())) if base else (None, None)
    lines = [f"{'run':40s} {'final loss':>10s}  {'- 32-bit, same seed':>19s}  vs the 32-bit seeds' range"]
    for optimizer, seed, final in rows:
        paired = f"{final - base[seed]:+19.4f}" if seed in base and optimizer != "zerofast 32-bit" else f"{'':19s}"
        where = ""
        if lo is not None and optimizer != "zerofast 32-bit":
            where = (
                "inside"
                if lo <= final <= hi
                else (f"above by {final - hi:.4f}" if final > hi else f"below by {lo - final:.4f}")
            )
        lines.append(f"{optimizer + ' seed ' + str(seed):40s} {final:10.4f}  {paired}  {where}")
    if base:
        lines.append(f"32-bit seeds: {lo:.4f} - {hi:.4f} (mean {statistics.fmean(base.values()):.4f})")
    return lines
