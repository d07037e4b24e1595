"""The checkpoint's format across zerofast versions: checkpoints written by the ShardedTensor code
(zerofast before its chunks became dcp.ChunkedTensor) load bitwise, into another world size, stage
and partition, with the new code; saving and loading raise no deprecation warning; and what is
written now is the same DCP metadata as then.

tests/data/sharded_tensor/ holds two such checkpoints, written by _write_fixture (below) with the
ShardedTensor code, and what their writers held (the full values, gathered from every
rank's pieces at the save; <name>.expected.pt, read with weights_only=True):
  stage3/      2 ranks, stage 3, flat partition, fp32: a 3-D parameter, matrices cut mid-row, a tied
               weight, a frozen parameter (stage 3 shards it: chunks too) and a buffer
  stage2-8bit/ 2 ranks, stage 2, flat partition, 8-bit state in blocks of 32 (uint8 codes in each
               parameter's shape, fp32 scales as 1-D tensors)
Rerunning _write_fixture now would write them through the new code: the files are the record of
the old writer, not something to regenerate."""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from harness import run_ranks

from zerofast import CommPolicy, MixedPrecisionPolicy, ZeroAdam
from zerofast import checkpoint as ck
from zerofast.checkpoint.io import read_small

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sharded_tensor")
KINDS = ("master", "exp_avg", "exp_avg_sq")
BLOCK = 32
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)


class Tiny(nn.Module):
    """Every case the boxes cover, small: a 3-D parameter (a flat range cut into up to 5 boxes),
    matrices and a vector cut wherever the partition falls, a tied weight (two names, one tensor), a
    frozen parameter and a buffer."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(11, 6)
        self.cube = nn.Parameter(torch.randn(3, 4, 6, generator=g))
        self.proj = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # tied: "embed.weight" and "head.weight"
        self.frozen = nn.Parameter(torch.randn(5, 3, generator=g), requires_grad=False)
        self.register_buffer("stat", torch.randn(4, generator=g))
        with torch.no_grad():
            for p in (self.embed.weight, self.proj.weight, self.proj.bias):
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(self.embed(tokens))) + 0.1 * self.cube.sum((0, 1))
        logits = self.head(h) + self.frozen.sum() + self.stat.sum()
        return nn.functional.cross_entropy(logits, (tokens + 1) % 11) + 1e-2 * self.cube.pow(2).sum()


def _make(world: int, stage: int, partition: str, bits: int, seed: int = 0):
    model = Tiny(seed)
    group = dist.new_group(list(range(world)))
    mixed = MixedPrecisionPolicy(state_bits=8, state_block=BLOCK) if bits == 8 else None
    opt = ZeroAdam(
        model, stage, comm=CommPolicy(partition=partition), mixed_precision=mixed, process_group=group, **HYPER
    )
    return model, opt


def _pieces(model, opt) -> dict:
    """This rank's pieces of the master and the moments (fp32 values: 8-bit state dequantized), the
    frozen parameter and the buffer as the model holds them, the step counts."""
    part = opt.checkpoint_view.trainable
    return {
        "pieces": {kind: part.state_pieces(kind) for kind in KINDS},
        "frozen": _frozen(model, opt),
        "stat": model.stat.detach().clone(),
        "steps": opt.checkpoint_view.step_counts(),
    }


def _frozen(model, opt) -> torch.Tensor:
    with opt.gathered_params():
        return model.frozen.detach().clone()


def _full(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Every kind of every trainable parameter, whole, from every rank's pieces."""
    shapes = {n: tuple(p.shape) for n, p in Tiny().named_parameters() if p.requires_grad}
    out = {}
    for kind in KINDS:
        flat = {n: torch.full((torch.Size(s).numel(),), float("nan")) for n, s in shapes.items()}
        for rank in per_rank:
            for name, offset, values in rank["pieces"][kind]:
                flat[name][offset : offset + values.numel()] = values.reshape(-1)
        for n, s in shapes.items():
            assert not flat[n].isnan().any(), f"{kind} of {n}: not every element came from some rank"
            out[f"{kind}/{n}"] = flat[n].view(s)
    return out


def _save(rank, world, path, stage, bits):
    model, opt = _make(world, stage, "flat", bits)
    for step in range(3):
        tokens = torch.randint(0, 11, (8,), generator=torch.Generator().manual_seed(100 * step + rank))
        model(tokens).backward()
        opt.step()
        opt.zero_grad()
    ck.save(path, model, opt, extra={"step": 3})
    return _pieces(model, opt)


def _write_fixture(root: str = DATA) -> None:
    """How tests/data/sharded_tensor/ was written (with the ShardedTensor code; see the docstring)."""
    for name, stage, bits in (("stage3", 3, 32), ("stage2-8bit", 2, 8)):
        path = os.path.join(root, name)
        shutil.rmtree(path, ignore_errors=True)
        saved = run_ranks(_save, 2, args=(path, stage, bits))
        expected = {
            **_full(saved),
            "frozen": saved[0]["frozen"],
            "stat": saved[0]["stat"],
            "steps": torch.tensor([saved[0]["steps"][n] for n in sorted(saved[0]["steps"])]),
        }
        torch.save(expected, path + ".expected.pt")


@pytest.fixture
def root():
    path = tempfile.mkdtemp(prefix="zerofast-format-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _expected(name: str) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(DATA, name + ".expected.pt"), weights_only=True)


def _load(rank, world, path, stage, partition, bits):
    model, opt = _make(world, stage, partition, bits, seed=7)  # other values: all must come from the file
    extra = ck.load(path, model, opt)
    return {**_pieces(model, opt), "extra": extra}


def _steps(loaded: dict) -> torch.Tensor:
    return torch.tensor([loaded["steps"][n] for n in sorted(loaded["steps"])])


# (fixture, the loading world size, stage, partition, state bits)
LOADS = [
    ("stage3", 3, 2, "round_robin", 32),  # 2 ranks -> 3, stage 3 -> 2, the frozen chunks into a replicated parameter
    ("stage3", 1, 1, "flat", 32),
    ("stage2-8bit", 3, 3, "greedy", 8),  # codes and scales resharded, bitwise
    ("stage2-8bit", 1, 2, "flat", 32),  # 8-bit into fp32: dequantized (through _Decoding's chunks)
]


@pytest.mark.parametrize("name, world, stage, partition, bits", LOADS, ids=[f"{c[0]}->w{c[1]}s{c[2]}" for c in LOADS])
def test_a_sharded_tensor_checkpoint_loads_bitwise_into_another_configuration(name, world, stage, partition, bits):
    want = _expected(name)
    loaded = run_ranks(_load, world, args=(os.path.join(DATA, name), stage, partition, bits))
    got = _full(loaded)
    for key in got:
        assert torch.equal(got[key], want[key]), f"{name}: {key} differs from what the ShardedTensor code saved"
    for rank, one in enumerate(loaded):
        assert one["extra"] == {"step": 3}, rank
        assert torch.equal(_steps(one), want["steps"]), rank
        assert torch.equal(one["frozen"], want["frozen"]) and torch.equal(one["stat"], want["stat"]), rank


def test_a_plain_model_and_to_torch_read_a_sharded_tensor_checkpoint():
    import torch.distributed.checkpoint as dcp

    for name in ("stage3", "stage2-8bit"):
        want, path = _expected(name), os.path.join(DATA, name)
        plain = Tiny(seed=9)
        sd = {"model": plain.state_dict()}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled.*", category=UserWarning)
            dcp.load(sd, checkpoint_id=path, no_dist=True)
        plain.load_state_dict(sd["model"])
        for n, p in plain.named_parameters():
            assert torch.equal(p.detach(), want[f"master/{n}"] if p.requires_grad else want["frozen"]), (name, n)
        assert torch.equal(plain.head.weight, want["master/embed.weight"]), name  # the tied weight's other name
        assert torch.equal(plain.stat, want["stat"]), name
        model_sd, adamw_sd = ck.to_torch(path)
        order = [n for g in read_small(path)["param_groups"] for n in g["params"]]  # to_torch's indices
        assert len(order) == len(adamw_sd["state"]) == 4, name
        for index, n in enumerate(order):
            assert torch.equal(model_sd[n], want[f"master/{n}"]), (name, n)
            for kind in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(adamw_sd["state"][index][kind], want[f"{kind}/{n}"]), (name, n, kind)


def _resave(rank, world, path, out, stage, bits):
    model, opt = _make(world, stage, "flat", bits, seed=7)
    ck.load(path, model, opt)
    ck.save(out, model, opt, extra={"step": 3})


def _chunks(path: str) -> dict:
    from zerofast.checkpoint import safe

    meta = safe.read_metadata(os.path.join(path, ".metadata")).state_dict_metadata
    return {
        key: (
            (md.size, md.properties, sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks))
            if hasattr(md, "chunks")
            else type(md).__name__
        )
        for key, md in meta.items()
    }


@pytest.mark.parametrize("name, stage, bits", [("stage3", 3, 32), ("stage2-8bit", 2, 8)])
def test_a_save_now_writes_what_the_sharded_tensor_code_wrote(name, stage, bits, root):
    """Loaded into its own configuration and saved again: the same DCP metadata (every key, size,
    properties and chunk) and the same values."""
    path, out = os.path.join(DATA, name), os.path.join(root, name)
    run_ranks(_resave, 2, args=(path, out, stage, bits))
    assert _chunks(out) == _chunks(path)
    (old_model, old_optim), (new_model, new_optim) = ck.to_torch(path), ck.to_torch(out)
    assert old_model.keys() == new_model.keys() and all(torch.equal(old_model[k], new_model[k]) for k in old_model)
    for i, state in old_optim["state"].items():
        assert all(torch.equal(v, new_optim["state"][i][k]) for k, v in state.items()), i


def _no_deprecation_warnings(rank, world, root):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        warnings.filterwarnings("error", message=".*ShardedTensor.*")
        for stage, bits in ((3, 32), (2, 8)):
            model, opt = _make(world, stage, "flat", bits)
            blocking, background = os.path.join(root, f"s{stage}-blocking"), os.path.join(root, f"s{stage}-async")
            ck.save(blocking, model, opt)
            ck.save(background, model, opt, blocking=False).wait()
            ck.load(blocking, model, opt)
            ck.load(background, model, opt)
            sd = opt.state_dict()  # by hand: ChunkedTensors straight to DCP
            by_hand = os.path.join(root, f"s{stage}-by-hand")
            dcp.save(sd, checkpoint_id=by_hand, process_group=opt.checkpoint_view.facts.group)
            dcp.load(sd, checkpoint_id=by_hand, process_group=opt.checkpoint_view.facts.group)
            opt.load_state_dict(sd)
    return True


def test_save_and_load_raise_no_deprecation_warning(root):
    """No FutureWarning or DeprecationWarning (ShardedTensor's) from a blocking or an asynchronous
    save, a load, or the optimizer's state dict through DCP by hand: each would be an error here.
    Nor from to_torch and export, in one process."""
    assert run_ranks(_no_deprecation_warnings, 2, args=(root,)) == [True, True]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        warnings.filterwarnings("error", message=".*ShardedTensor.*")
        for stage in (3, 2):
            ck.to_torch(os.path.join(root, f"s{stage}-blocking"))
            ck.export(os.path.join(root, f"s{stage}-blocking"), os.path.join(root, f"s{stage}.safetensors"))


def test_chunked_tensor_describes_chunks_and_computes_nothing():
    from torch.distributed.checkpoint.metadata import MetadataIndex

    flat = torch.arange(10.0)
    chunks = [((0, 2), flat[:2].view(1, 2)), ((1, 0), flat[2:10].view(2, 4))]
    t = ck.ChunkedTensor((3, 4), torch.float32, chunks)
    assert t.shape == (3, 4) and t.dtype == torch.float32 and t.device == flat.device
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in t.__create_chunk_list__()] == [
        ((0, 2), (1, 2)),
        ((1, 0), (2, 4)),
    ]
    items = t.__create_write_items__("w", t)
    assert [tuple(i.tensor_data.chunk.offsets) for i in items] == [(0, 2), (1, 0)]
    assert all(i.tensor_data.size == (3, 4) and i.tensor_data.properties.dtype == torch.float32 for i in items)
    shard = t.__get_tensor_shard__(MetadataIndex("w", (1, 0)))
    shard[0, 0] = -1.0  # a view of the live state: a load writes through it
    assert flat[2] == -1.0
    with pytest.raises(ValueError, match="no chunk"):
        t.__get_tensor_shard__(MetadataIndex("w", (2, 0)))
    with pytest.raises(TypeError, match="not a tensor to compute with"):
        t.clone()
    # What moves an optimizer's state (Accelerate's prepare() moves it to the device) is named, with the fix.
    with pytest.raises(TypeError, match="zerofast.integrations.accelerate.ZeroAccelerator"):
        t.to(torch.float16)
    with pytest.raises(ValueError, match="outside"):
        ck.ChunkedTensor((3, 4), torch.float32, [((2, 3), flat[:2].view(1, 2))])
    with pytest.raises(ValueError, match="float64"):
        ck.ChunkedTensor((3, 4), torch.float64, chunks)
    assert "(0, 2)+(1, 2)" in repr(t)
