"""One rank of a replica group on torchft, for tests/test_torchft.py: the tiny GPT, ZeroAdam over
zerofast.integrations.torchft.ReplicaGroups, one JSON line per event on stdout.

    python tests/jobs/ft_job.py GROUP RANK PORT LIGHTHOUSE DIR STAGE STEPS [FAULT]

GROUP's ranks are their own c10d world (MASTER_PORT=PORT). Rank r of group g reads the batch of data
-parallel rank g*2+r at the committed step (training.rank_batch), so a healed group computes what the
lost one would have. FAULT "exit_in_backward:S": this rank leaves (os._exit) inside backward at step
S; "relaunch": this is a relaunched rank, which waits at no gate. Gates (files in DIR, opened by the
test): "start" before the optimizer is built (the first quorum then holds both groups); "rejoin",
opened once group 0 waits before its step RELAUNCH_AT and the relaunched ranks are up (their start
takes seconds here, more than the rest of the run), for both. The run ends after step STEPS - 1 and
three steps in a row committed by both groups.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared modules
from tolerances import HYPER  # noqa: E402
from training import rank_batch  # noqa: E402

from zerofast import ZeroAdam, checkpoint  # noqa: E402
from zerofast.integrations.torchft import ReplicaGroups  # noqa: E402
from zerofast.tools.models import make_gpt  # noqa: E402

K = 2  # ranks per replica group
RELAUNCH_AT = 5  # group 0 waits for the relaunched group before this step (or the first after it trained alone)


def main(
    group: int, rank: int, port: int, lighthouse: str, gates: str, stage: int, steps: int, fault: str, offload: str
) -> None:
    def log(event, **kw):
        print(json.dumps({"g": group, "r": rank, "event": event, "at": time.time(), **kw}), flush=True)

    def gate(name):
        while not os.path.exists(os.path.join(gates, name)):
            time.sleep(0.02)

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=K, timeout=datetime.timedelta(seconds=20)
    )
    replicas = ReplicaGroups(f"group{group}", lighthouse=lighthouse, timeout=5)
    log("started", pid=os.getpid())
    gate("start" if fault != "relaunch" else "rejoin")
    model = make_gpt("tiny")
    # offload "disk": the state in files of this rank's own (a healed group receives it into them)
    where = f"disk:{os.path.join(gates, f'state-g{group}-r{rank}')}" if offload == "disk" else None
    opt = ZeroAdam(model, stage=stage, process_group=replicas, offload=where, **HYPER)
    opt.zero_grad()  # the first quorum: a relaunched group heals here (the loop's first zero_grad is then a no-op)
    log("built", step=replicas.step, where=opt.checkpoint_view.steps_taken())
    exit_at = int(fault.split(":")[1]) if fault.startswith("exit_in_backward:") else None
    joint = 0  # consecutive steps committed with both groups
    alone = False  # committed a step without the other group: the loss was seen
    while replicas.step < steps or joint < 3:  # both groups stop after the same step
        # Group 0 waits for the relaunched group only once it has trained alone: were the test slow to
        # kill group 1, waiting at RELAUNCH_AT before that would keep the step alone from coming.
        parks = replicas.step >= RELAUNCH_AT and alone
        if group == 0 and parks and not os.path.exists(os.path.join(gates, "rejoin")):
            log("parked", step=replicas.step)
            gate("rejoin")
        opt.zero_grad()
        step, participants = replicas.step, replicas.participants
        x, y = rank_batch(model, step, group * K + rank)
        _, loss = model(x, y)
        if exit_at == step:
            loss.register_hook(lambda g: os._exit(3))  # inside backward, its peers mid-collective
        loss.backward()
        opt.step()
        kind = "no_commit" if opt.step_was_skipped else "commit"
        if kind == "commit":
            joint = joint + 1 if participants == 2 else 0
            alone = alone or participants == 1
        log(kind, step=step, participants=participants)
    digest = hashlib.sha256()
    for t in opt.checkpoint_view.flat_state().values():
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    full = opt.full_state_dict()
    if replicas.saves:  # one group saves: a plain K-rank checkpoint
        checkpoint.save(os.path.join(gates, "ckpt"), model, opt)
        log("saved")
    log("done", step=replicas.step, sha256=digest.hexdigest(), joint=joint)
    if group == 0 and rank == 0:
        torch.save(full, os.path.join(gates, "final.pt"))
    replicas.manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(
        int(a[0]),
        int(a[1]),
        int(a[2]),
        a[3],
        a[4],
        int(a[5]),
        int(a[6]),
        a[7] if len(a) > 7 else "none",
        a[8] if len(a) > 8 else "none",
    )
