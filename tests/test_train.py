"""The main job and the memory estimator: measured bytes on real ranks against the ZeRO paper's
formulas, a short real training run, and clear exits on bad arguments."""

import os
import re
import subprocess
import sys

import pytest
import torch
from harness import run_ranks
from tolerances import HYPER
from training import rank_batch, zero_options

from zerofast import CommPolicy, MixedPrecisionPolicy, UnitPolicy, ZeroAdam
from zerofast.estimate import estimate_memory
from zerofast.tools.models import make_gpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _measured(rank, world, stage, precision="fp32"):
    model = make_gpt("tiny")
    if stage == 0:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), **HYPER)
        _, loss = ddp(*rank_batch(model, 0, rank))
        loss.backward()
        opt.step()
        state = list(opt.state.values())
        return {
            "params": sum(p.nbytes for p in model.parameters()),
            "grads": sum(p.grad.nbytes for p in model.parameters()),
            "optimizer": sum(s[k].nbytes for s in state for k in ("exp_avg", "exp_avg_sq")),
        }
    opt = ZeroAdam(model, **zero_options(stage, bucket_mb=0.01), mixed_precision=PRECISIONS[precision], **HYPER)
    _, loss = model(*rank_batch(model, 0, rank))
    opt.backward(loss)
    opt.step()
    r = opt.report().memory
    return {"params": r.params, "grads": r.grads + r.grad_shard, "optimizer": r.optimizer + r.master_copy}


# 8-bit state in blocks of 32: the tiny GPT's parameters are mostly multiples of 32 elements, so the
# block alignment the estimate leaves out stays within what it reports as zerofast's extra
PRECISIONS = {
    "fp32": None,
    "mixed": "bf16",
    "mixed8": MixedPrecisionPolicy(torch.bfloat16, state_bits=8, state_block=32),
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "stage, precision",
    [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "mixed"), (2, "mixed"), (3, "mixed"), (3, "mixed8")],
)
def test_estimate_matches_measured_bytes(world, stage, precision):
    comm = CommPolicy(bucket_mb=0.01) if stage in (1, 2) else None  # stage 3's buckets are its units
    est = estimate_memory(make_gpt("tiny"), world, stage, mixed_precision=PRECISIONS[precision], comm=comm)
    for rank, m in enumerate(run_ranks(_measured, world, args=(stage, precision))):
        for kind in ("params", "grads", "optimizer"):
            want = getattr(est, kind)
            if stage == 0:
                assert m[kind] == want, f"DDP {kind}: measured {m[kind]} != estimate {want}"
            else:  # the table's value, plus at most what the estimate reports as zerofast's extra
                assert want - 4 * 4 * world <= m[kind] <= want + est.zerofast_extra, (
                    f"stage {stage} rank {rank}/{world} {kind}: measured {m[kind]}, estimate {want} (+{est.zerofast_extra})"
                )


def test_estimate_formulas():
    phi = 1_000_000
    ddp = estimate_memory(phi, 4, 0, mixed_precision="bf16")
    assert (ddp.params, ddp.grads, ddp.optimizer) == (2 * phi, 2 * phi, 12 * phi)  # the paper's 16Φ
    s1, s2, s3 = (estimate_memory(phi, 4, s, mixed_precision="bf16") for s in (1, 2, 3))
    assert (s1.params, s1.grads, s1.optimizer) == (2 * phi, 2 * phi, 3 * phi)  # 4Φ + 12Φ/N
    assert (s2.params, s2.grads, s2.optimizer) == (2 * phi, phi // 2, 3 * phi)  # 2Φ + 14Φ/N
    assert (s3.params, s3.grads, s3.optimizer) == (phi // 2, phi // 2, 3 * phi)  # 16Φ/N
    f = estimate_memory(phi, 2, 0, mixed_precision=None)
    assert (f.params, f.grads, f.optimizer) == (4 * phi, 4 * phi, 8 * phi)
    # 8-bit state: 1 byte per moment element and one fp32 scale per block of each moment
    q = estimate_memory(phi, 4, 3, mixed_precision=MixedPrecisionPolicy(torch.bfloat16, state_bits=8, state_block=256))
    assert q.optimizer == (4 + 2) * phi // 4 + 2 * 4 * -(-phi // 4 // 256)
    q = estimate_memory(phi, 1, 0, mixed_precision=MixedPrecisionPolicy(state_bits=8, state_block=64))
    assert q.optimizer == 2 * phi + 2 * 4 * -(-phi // 64)


@pytest.mark.parametrize(
    "make_kwargs, message",
    [
        (lambda: dict(model_or_param_count=-1, world=2, stage=1), "count >= 0; got -1"),
        (lambda: dict(model_or_param_count=10, world=0, stage=1), "world must be an integer >= 1; got 0"),
        (lambda: dict(model_or_param_count=10, world=2, stage=4), "stage must be 0, 1, 2 or 3; got 4"),
        (
            lambda: dict(model_or_param_count=10, world=2, stage=1, mixed_precision="fp8"),
            "mixed_precision must be None, 'no', 'bf16', 'fp16' or a MixedPrecisionPolicy; got 'fp8'",
        ),
        # ZeroAdam's own checks, through the same code: what it rejects, the estimator rejects
        (
            lambda: dict(model_or_param_count=10, world=2, stage=3, comm=CommPolicy(bucket_mb=8)),
            "bucket_mb sets stages 1 and 2's buckets",
        ),
        (
            lambda: dict(model_or_param_count=10, world=2, stage=2, comm=CommPolicy(bucket_mb=True)),
            "bucket_mb must be None or a number > 0; got True",
        ),
        (
            lambda: dict(model_or_param_count=10, world=2, stage=1, units=UnitPolicy(min_unit_mb=1)),
            "units apply to stage 3 only",
        ),
        (
            lambda: dict(model_or_param_count=10, world=2, stage=0, comm=CommPolicy(bucket_buffers=-1)),
            "bucket_buffers must be an integer >= 0",
        ),
    ],
)
def test_estimate_bad_arguments(make_kwargs, message):
    with pytest.raises(ValueError, match=message):
        estimate_memory(**make_kwargs())


@pytest.mark.parametrize(
    "name, where",
    [("precision", "mixed_precision="), ("bucket_mb", "comm=CommPolicy"), ("bucket_buffers", "comm=CommPolicy")],
)
def test_estimate_old_keywords_name_their_new_place(name, where):
    with pytest.raises(TypeError, match=f"the keyword {name}= is now {re.escape(where)}"):
        estimate_memory(10, 2, 1, **{name: 1})


def test_estimate_accepts_what_zero_adam_accepts():
    """bucket_buffers=0 (no bound) and the policies' other values: accepted, and no bound means every
    gradient byte may sit in a pooled buffer."""
    phi = 1_000_000
    unbounded = estimate_memory(phi, 4, 2, comm=CommPolicy(bucket_buffers=0))
    bounded = estimate_memory(phi, 4, 2, comm=CommPolicy(bucket_buffers=2, bucket_mb=0.5))
    assert unbounded.zerofast_extra >= 4 * phi > bounded.zerofast_extra
    fp32_reduce = estimate_memory(phi, 4, 2, mixed_precision=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    assert fp32_reduce.grads == 4 * phi // 4 and fp32_reduce.params == 2 * phi  # the shard in float32


def test_estimator_imports_no_compiled_code():
    """The estimator runs where the extension was never built: with zerofast._C unimportable,
    `import zerofast`, estimate_memory and the command line all work."""
    code = (
        "import sys; sys.modules['zerofast._C'] = None\n"
        "import zerofast\n"
        "from zerofast import CommPolicy, estimate_memory\n"
        "print(estimate_memory(7_500_000_000, 64, 3, mixed_precision='bf16').total)\n"
        "from zerofast.tools.estimate import main\n"
        "main(['--params', '7.5B', '--world', '64'])\n"
        "assert 'zerofast.optim.zero_adam' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "stage 3" in out.stdout


def _run(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_train_command_loss_goes_down():
    """One launch (fp32 runs in every other launch of the main job): bf16, clipping, and hybrid
    sharding at --shard-size 1 (replicated on 2 ranks), whose report names the traffic across
    machines against its formula."""
    out = _run(
        "zerofast.train",
        "--nproc",
        "2",
        "--model",
        "tiny",
        "--steps",
        "12",
        "--stage",
        "3",
        "--batch",
        "8",
        "--lr",
        "1e-2",
        "--mixed-precision",
        "bf16",
        "--max-grad-norm",
        "1.0",
        "--shard-size",
        "1",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout + out.stderr
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) over 12 steps", text).groups())
    assert last < first - 0.1, text
    assert "per rank, bytes after step()" in text, text
    line = next(t for t in text.splitlines() if t.startswith("communication per step, replicate"))
    assert "= 1.00 Φ (formula: Φ/K = Φ/1" in line, line


def test_train_command_with_tensor_parallelism():
    """--tp 2 on 4 ranks: the tiny Llama under torchtitan's plan, ZeroAdam stage 3 over the ("dp", "tp")
    mesh (the library's exactness, stages 1-3: tests/test_tensor_parallel.py); the job trains, reports
    each rank's bytes against the estimate with tp, and its data-parallel traffic against a tp rank's
    part: 2Φ, as this tiny model has two units (the root's and its merged blocks'), both carried from
    forward into backward ([Note: forward hands over to backward]): one gather and one reduce."""
    text = _tp_job("tp 2 x dp 2", "--stage", "3", "--max-grad-norm", "1.0")
    line, moved = _traffic(text, "shard")
    assert "(formula: 3Φ" in line, line
    assert 2.0 <= moved < 2.1, line  # the reduce and the one gather of a tp rank's part, plus padding


def _tp_job(mesh: str, *argv: str) -> str:
    """The main job with --tp 2 on 4 ranks (the tiny Llama, 6 steps, and `argv`): it ends with code 0,
    says its mesh and lowers the loss; its output."""
    out = _run(
        "zerofast.train", "--nproc", "4", "--tp", "2", "--model", "tiny", "--steps", "6", "--batch", "4",
        "--lr", "1e-2", *argv,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert f"tensor parallel over 2 ranks ({mesh})" in text, text
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) over 6 steps", text).groups())
    assert last < first - 0.1, text
    return text


def _traffic(text: str, group: str) -> tuple[str, float]:
    """The closing table's line for `group`'s traffic, of a tp rank's part, and its bytes in Φ."""
    line = next(t for t in text.splitlines() if t.startswith(f"communication per step, {group}"))
    assert "on each of 2 tensor-parallel ranks" in line, line
    return line, float(re.search(r"= ([\d.]+) Φ", line).group(1))


def test_train_command_with_tensor_parallelism_hybrid_sharding_and_the_state_on_disk(tmp_path):
    """--tp 2 --shard-size 1 --offload disk on 4 ranks: a ("replicate", "dp", "tp") mesh (each tp
    rank's part unsharded, replicated twice), the state in files (the library's exactness under tp,
    the disk bitwise the state in memory: tests/test_tensor_parallel.py); the job trains, says where
    the state lives (the optimizer column 0, estimated so) and its replicas' traffic: Φ/K of a tp
    rank's part."""
    text = _tp_job("tp 2 x dp 1 x replicate 2", "--stage", "2", "--shard-size", "1", "--offload", f"disk:{tmp_path}")
    assert f"optimizer state on disk under {tmp_path}" in text, text
    rows = [t.split() for t in text.splitlines() if re.match(r"^ {3}[0-3] +[\d,]+ ", t)]
    assert len(rows) == 4 and all(r[5] == r[6] == "0" for r in rows), rows  # optimizer, its estimate
    line, moved = _traffic(text, "replicate")
    assert "(formula: Φ/K = Φ/1" in line, line
    assert 1.0 <= moved < 1.1, line  # the replicas' all_reduce of a tp rank's part, plus padding


def _pipeline_oracle(steps: int, data_world: int, batch: int) -> list[float]:
    """The main job's losses, step by step, by single-process AdamW on the tiny Llama over the job's
    global batch (every data-parallel rank's text_batch), clipped at 1.0 as the job is told."""
    import torch.nn.functional as F

    from zerofast.tools.data import corpus_tokens, text_batch
    from zerofast.tools.models import LLAMA_CONFIGS, TitanLlama
    from zerofast.tools.train._loop import TP_SEQ

    model, tokens, losses = TitanLlama(**LLAMA_CONFIGS["tiny"]), corpus_tokens(), []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(steps):
        ids = torch.cat([text_batch(tokens, batch, TP_SEQ, seed=step * data_world + r)[0] for r in range(data_world)])
        logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_train_command_with_pipeline_parallelism():
    """--pp 2 on 4 ranks (pp 2 x dp 2, the tiny Llama cut in two, 1F1B over 4 micro-batches, ZeroAdam
    stage 3): the job's losses are single-process AdamW's over its global batch, each rank's bytes
    its stage's part's estimate, and its data-parallel traffic 2Φ of the part (the parts kept gathered
    for the step: one gather, one reduce). (--pp with --tp and --shard-size: the mesh below, and the
    library under those meshes in tests/test_pipelining.py; a launch each costs ~20 s of the suite.)"""
    common = ["zerofast.train", "--nproc", "4", "--pp", "2", "--model", "tiny", "--batch", "4", "--lr", "1e-2"]
    out = _run(*common, "--steps", "6", "--stage", "3", "--max-grad-norm", "1.0")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "2 pipeline stages x 4 micro-batches (1F1B) (dp 2 x pp 2)" in text, text
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) over 6 steps", text).groups())
    want = _pipeline_oracle(6, 2, 4)
    # Printed to 4 decimals (5e-5), the run within 16 ulps a step of AdamW (tests/test_pipelining.py).
    assert abs(first - want[0]) <= 1e-4 and abs(last - want[-1]) <= 1e-4, (first, last, want)
    rows = [t.split() for t in text.splitlines() if re.match(r"^ {3}[0-3] +[\d,]+ ", t)]
    assert len(rows) == 4 and all(r[1] == r[2] and r[3] == r[4] and r[5] == r[6] for r in rows), rows
    assert rows[0][1] != rows[2][1], rows  # the stages hold different parts
    line = next(t for t in text.splitlines() if t.startswith("communication per step, shard"))
    assert "(formula: 2Φ" in line and 2.0 <= float(re.search(r"= ([\d.]+) Φ", line).group(1)) < 2.1, line


def test_the_main_jobs_mesh_puts_pp_outermost_and_tp_innermost():
    from argparse import Namespace

    from zerofast.tools.train._loop import mesh_layout

    for (pp, tp, k), want in (
        ((2, None, None), ((2, 4), ("pp", "dp"))),
        ((2, 2, None), ((2, 2, 2), ("pp", "dp", "tp"))),
        ((2, None, 2), ((2, 2, 2), ("pp", "replicate", "dp"))),
        ((2, 2, 1), ((2, 2, 1, 2), ("pp", "replicate", "dp", "tp"))),
        ((None, 2, 1), ((4, 1, 2), ("replicate", "dp", "tp"))),
    ):
        assert mesh_layout(Namespace(pp=pp, tp=tp, shard_size=k), 8) == want, (pp, tp, k)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--nproc", "4", "--pp", "3"],
            "--pp must be at least 1 and divide the ranks (4) and the small Llama's 8 layers",
        ),
        (["--nproc", "4", "--pp", "2", "--micro-batches", "3"], "--micro-batches must be at least --pp (2) and divide"),
        (
            ["--nproc", "4", "--pp", "4", "--batch", "2"],
            "--micro-batches must be at least --pp (4) and divide --batch (2)",
        ),
        (["--micro-batches", "2"], "--micro-batches applies to --pp; got --micro-batches 2 without it"),
        (["--nproc", "4", "--pp", "2", "--compare"], "--compare is not available with --pp"),
        (
            ["--nproc", "4", "--pp", "2", "--shard-size", "3"],
            "--shard-size must divide each stage's data-parallel ranks (2) with --pp; got 3",
        ),
        (
            ["--nproc", "8", "--pp", "2", "--tp", "2", "--shard-size", "3"],
            "--shard-size must divide the data-parallel ranks (--nproc / --tp = 4) with --tp; got 3",
        ),
        (
            ["--nproc", "4", "--tp", "3"],
            "--tp must be at least 1 and divide the ranks (4) and the small Llama's 8 heads; got 3",
        ),
        (["--nproc", "2", "--tp", "2", "--stage", "2", "--compare"], "--compare is not available with --tp yet"),
        (
            ["--nproc", "4", "--tp", "2", "--shard-size", "3"],
            "--shard-size must divide the data-parallel ranks (--nproc / --tp = 2) with --tp; got 3",
        ),
        (["--stage", "4"], "--stage must be 1, 2 or 3; got 4"),
        (["--steps", "-3"], "--steps must be 0 or more; got -3"),
        (["--model", "huge"], "--model must be one of tiny, small; got 'huge'"),
        (["--nproc", "0"], "--nproc must be at least 1; got 0"),
        (["--partition", "zigzag"], "--partition must be one of flat, round_robin, greedy; got 'zigzag'"),
        (["--mixed-precision", "fp8"], "--mixed-precision must be bf16 or fp16; got 'fp8'"),
        (["--state-bits", "16"], "--state-bits must be 32 or 8; got 16"),
        (["--max-grad-norm", "0"], "--max-grad-norm must be positive; got 0.0"),
        (["--shard-size", "0"], "--shard-size must be at least 1; got 0"),
        (["--resume"], "--save-every, --keep, --save-async and --resume need --save-dir"),
        (["--save-async"], "--save-every, --keep, --save-async and --resume need --save-dir"),
        (["--save-dir", "d", "--keep", "1"], "--keep must be at least 2; got 1"),
        (["--save-dir", "d", "--save-every", "-1"], "--save-every must be 0 or more; got -1"),
        (["--timeout", "0"], "--timeout must be positive; got 0.0"),
        (["--max-restarts", "-1"], "--max-restarts must be 0 or more; got -1"),
        (["--save-dir", "d", "--resume", "--compare"], "use it without --resume"),
        (["--replica-groups", "1"], "--replica-groups must be 0 (off) or at least 2; got 1"),
        (["--lose-group-at", "2"], "--lose-group-at needs --replica-groups"),
        (["--replica-groups", "2", "--steps", "6", "--lose-group-at", "3"], "[0, --steps - 3) = [0, 3); got 3"),
        (["--replica-groups", "2", "--compare"], "without --save-dir, --resume, --compare and --plot"),
        (["--offload", "nvme"], "--offload must be host, disk or disk:PATH; got 'nvme'"),
        (["--offload", "disk:"], "--offload must be host, disk or disk:PATH; got 'disk:'"),
        (["--offload", "host", "--replica-groups", "2"], "--offload applies to the main run"),
    ],
)
def test_train_bad_arguments_exit_2(argv, message, capsys):
    from zerofast.tools.train import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "gpus, argv, want",
    [
        (0, [], 2),  # gloo on the CPU: two ranks by default
        (1, [], 1),  # NCCL by default with a GPU: one rank per GPU, so `make demo` runs on one GPU
        (4, [], 4),
        (1, ["--backend", "gloo"], 2),  # gloo ranks may share the CPU (and a GPU)
        (2, ["--nproc", "1"], 1),
    ],
)
def test_train_nproc_follows_the_gpus(gpus, argv, want, monkeypatch):
    """Parsing only (no launch): --nproc's default under NCCL is the GPUs visible."""
    from zerofast.tools.train import parse_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert parse_args(argv).nproc == want


def test_train_offload_folder(tmp_path, monkeypatch):
    """Parsing only: --offload as ZeroAdam's offload= shortcut, its folder absolute; disk alone is
    offload/ under --save-dir, else under the working directory."""
    from zerofast.tools.train import parse_args

    monkeypatch.chdir(tmp_path)
    assert parse_args([]).offload is None
    assert parse_args(["--offload", "host"]).offload == "host"
    assert parse_args(["--offload", "disk"]).offload == f"disk:{tmp_path / 'offload'}"
    assert parse_args(["--offload", "disk", "--save-dir", "ck"]).offload == f"disk:{tmp_path / 'ck' / 'offload'}"
    assert parse_args(["--offload", "disk:st"]).offload == f"disk:{tmp_path / 'st'}"


def test_train_nproc_beyond_the_gpus_is_refused(monkeypatch, capsys):
    from zerofast.tools.train import parse_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as e:
        parse_args(["--nproc", "2"])
    assert e.value.code == 2
    assert "--nproc 2 needs 2 GPUs under NCCL (one per rank); 1 visible" in capsys.readouterr().err


def test_cli_exit_codes():
    bad = _run("zerofast.train", "--stage", "4", timeout=120)
    assert bad.returncode == 2 and "--stage must be 1, 2 or 3; got 4" in bad.stderr
    ok = _run("zerofast.estimate", "--params", "7500000000", "--world", "64", timeout=120)
    assert ok.returncode == 0 and "stage 3" in ok.stdout
    bad = _run("zerofast.estimate", "--params", "10", "--world", "0", timeout=120)
    assert bad.returncode == 2 and "--world must be at least 1; got 0" in bad.stderr


def test_resume_continues_the_interrupted_run_bitwise(tmp_path):
    """8 steps in one go against 4 steps, a stop, and --resume to 8: the same final checkpoint, bitwise
    (the data position is the step, and the RNG state travels in the checkpoint); the interrupted
    run saves asynchronously (--save-async), the whole one blocking. (A resume on other ranks and
    another stage: tests/test_launch.py's relaunch on fewer ranks, and tests/test_checkpoint.py's
    reshards; fp32 state into 8-bit: tests/test_checkpoint_8bit.py.) The runs keep 8-bit Adam state.
    The interrupted run keeps it on disk (--offload disk: the folder the job chooses under --save-dir,
    then --offload disk:PATH): its losses are bitwise those of the whole run in memory, its progress
    line and closing table say where the state lives and what its I/O cost, and its files are gone
    at exit. (The offloaded step against the one in memory, case by case: tests/test_offload.py.)"""
    from zerofast import checkpoint
    from zerofast.checkpoint.io import read_small

    common = ["zerofast.train", "--nproc", "2", "--model", "tiny", "--stage", "3", "--batch", "4", "--lr", "1e-2"]
    common += ["--state-bits", "8"]  # 8-bit Adam state through the main job's save and resume
    whole, split, offload_dir = str(tmp_path / "whole"), str(tmp_path / "split"), str(tmp_path / "state")
    texts = []
    for argv in (
        [*common, "--steps", "8", "--save-dir", whole],
        [*common, "--steps", "4", "--save-dir", split, "--save-every", "2", "--keep", "2", "--save-async"]
        + ["--offload", "disk"],
        [*common, "--steps", "8", "--save-dir", split, "--resume", "--keep", "2", "--save-async"]
        + ["--offload", f"disk:{offload_dir}"],
    ):
        out = _run(*argv)
        assert out.returncode == 0, out.stdout + out.stderr
        texts.append(out.stdout + out.stderr)
    in_memory, first, resumed = texts
    assert "resumed from" in resumed and "at step 4" in resumed
    assert "per rank, bytes after step() (fp32: 4 + 4 + 2 + scales per parameter" in resumed
    assert "state on disk" not in in_memory and "optimizer state on disk under" not in in_memory
    assert f"optimizer state on disk under {os.path.join(split, 'offload')}" in first  # the job's own folder
    assert f"optimizer state on disk under {offload_dir}" in resumed
    assert re.search(
        r"\] 8/8  loss [\d.]+  [\d,]+ tok/s  state on disk: [\d.]+ \w+ r\+w per step at [\d,]+ MB/s", resumed
    )
    rows = [t for t in resumed.splitlines() if re.match(r"\s+[01] files [\d.]+ \w+, window", t)]
    assert len(rows) == 2 and all("r+w per step at" in row for row in rows), resumed
    assert sorted(os.listdir(split)) == ["step-000004", "step-000008"]  # keep=2 purged step 2; offload/ removed
    assert os.listdir(offload_dir) == []  # every rank's files removed at exit
    want = read_small(os.path.join(whole, "step-000008"))["extra"]["losses"]
    got = [read_small(os.path.join(split, f"step-00000{s}"))["extra"]["losses"] for s in (4, 8)]
    assert len(want) == 8 and got[0] + got[1] == want, (got, want)  # exactly: the offloaded step is bitwise
    (a_model, a_optim), (b_model, b_optim) = (
        checkpoint.to_torch(os.path.join(d, "step-000008")) for d in (whole, split)
    )
    assert all(torch.equal(a_model[k], b_model[k]) for k in a_model)
    for i, state in a_optim["state"].items():
        assert all(torch.equal(state[k], b_optim["state"][i][k]) for k in state)
