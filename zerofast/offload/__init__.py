"""Where the optimizer state lives (OffloadPolicy in zerofast/config.py), and everything a step does
because of it:
  stores.py  DeviceState, HostState (pinned host memory), DiskState (files, through a bounded window);
             ShardFiles: stage 3's parameter and gradient shards in files ([Note: parameters on disk])
  update.py  the offloaded step, called by zerofast/optim/step.py at fixed points: phase 3 through a
             store, its all-or-none commit, the delayed update's thread, the model's writes
ShardState (zerofast/optim/state.py) and the checkpoint view read the store's tensors wherever they are.

[Note: offload schedule]
What leaves the device, when the CPU steps it, and when the parameters come back:
- Backward is unchanged: each bucket's gradient is reduced into the rank's gradient shard, on the
  device, as soon as the bucket is complete ([Note: bucket order]).
- Phase 2 (the agreement, the overflow check, the global norm) runs as without offload: it needs
  every gradient, so the update starts after the last reduce, whatever the placement.
- Phase 3 walks the shard in chunks (`window_mb` / 3 each, a multiple of 8-bit state's block):
  "disk": three slots in flight: chunk k+1 is read on the I/O threads while the CPU kernel steps
  chunk k and chunk k-1 is written; "host": the state is stepped where it lies, in host memory. On a
  GPU, each chunk's gradients are copied to the host before its step and its updated parameters
  (the master's rounding) back to the device after it; the next forward starts after the last
  copy (the step returns then).
- Phase 4 (stages 1 and 2) gathers the updated parameters as without offload; stage 3's next
  forward gathers them.
What overlaps what: the disk's reads and writes overlap the CPU kernel and each other; the device's
copies are ordered with the kernel chunk by chunk. The update does not overlap backward yet: every
setting waits for the whole gradient (the CPU step of a bucket as soon as its reduce ends, ZeRO-
Offload's schedule, is the next step of this work: see docs/offload.md); the delayed update overlaps
step t's whole phase 3 with step t+1's forward and backward ([Note: the delayed update]).

[Note: the all-or-none offloaded step]
A step on disk reads generation g of the files and writes generation g+1 (two sets of files, each
preallocated at construction so that a full disk is found then, not in a step). Only when every
chunk of every rank was written does every rank switch to g+1 (one small all_reduce of who failed,
over every data-parallel rank, replicas included); otherwise every rank keeps g and restores the
parameters it updated in memory from g's master (their rounding, as the kernel wrote them), the
step counts unchanged: the step was not applied anywhere, as a failure before the update.

[Note: the delayed update]
OffloadPolicy(delayed_update=True) is ZeRO-Offload's one-step-delayed parameter update (DPU), a
different algorithm, never the default: step t's phase 3 (the gradient copies, the CPU kernel, the
I/O) runs on a thread, from a copy of the step's reduced gradients on the host, writing the new
parameter values into staging buffers; step() returns at once, and step t+1's forward and backward
run with the parameters from before it. Step t+1's step(), after its phase 2 (its reduces waited
for), waits for the thread, agrees (disk) that every rank wrote its update, applies the staged values
(stages 1 and 2 then gather them) and starts its own. So W_{t+1} = AdamW(W_t, the gradient at
W_{t-1}): AdamW applied one step late (tests/oracles.py single_process_delayed). Whatever reads the
state or the whole model first applies the update in flight (Stepper.quiesce: gathered_params(),
full_state_dict(), a checkpoint) and so does opt.flush(). It costs a copy of the gradient shard and
of the owned parameters on the host. A failed write of the delayed update raises at the next step()
(or flush) on every rank, which then drops that step's gradients too.

[Note: parameters on disk]
OffloadPolicy(params="disk") at stage 3 (ZeRO-Infinity's offload_param): this rank's parameter shard,
gradient shard and frozen parameters' shard are files under `path` (stores.py's ShardFiles), mapped
shared and handed to the optimizer as its flat tensors, so every reader and writer of a shard (the
unit gathers, the reduces in the compiled BucketComm, the fused kernel, the guard's writes,
checkpoints, generation) runs unchanged and the run is bitwise the same as in memory. What stays
resident is bounded, not the model's size: a unit's shard is read as its gather starts (explicit
reads of the file into the unit buffer, as far ahead as stage 3 prefetches: no page of the mapping
becomes resident, and a failed read is an OffloadError naming the file and the rank; the unit
buffer's memory comes from a pool, faulted in once: [Note: unit buffer pool] in csrc/unit_pool.cpp);
the pages the reduces wrote are dropped at every unit's release (a reduce still in flight is safe: a
shared file mapping's dirty pages stay in the page cache). The step reads each window chunk's gradients and
writes its updated parameters by explicit I/O, so a failure there is an OffloadError naming the file
and the rank, and the step is applied on every rank or on none: with the state on disk, settled
with the state's ([Note: the all-or-none offloaded step]); with the state in memory, in two passes
([Note: the all-or-none step with the state in memory] in update.py; the master is then a tensor of
its own in fp32 too). So a rank holds the units in flight, the gradient buckets in flight and, state
on disk, the window; the files and the page cache hold the rest (the kernel writes dirty pages back
and reclaims clean ones under memory pressure). Not done here: the delayed update's thread works
through the mapping, where a failing disk is the kernel's SIGBUS, and so do the reduces that write
the gradient shard in backward; a write's error the kernel meets only at its writeback is reported
by no call (as for the state's files: nothing is fsync'ed); the files are preallocated at
construction, so a full disk is named then, with the bytes needed and free. The GPU's pinned buffers and side-stream
copies are not built (a CUDA model's params= is a named error).

[Note: files of a killed job]
Each optimizer writes under PATH/zerofast-<host>-<pid>-<id>/ with a lock file it holds (flock) for
its life; the folder is removed when the optimizer is collected or the process exits. A folder
whose lock nobody holds belongs to a process that died: it is never read (an optimizer reads only
files it created and wrote) and a new optimizer under the same PATH removes it.

[Note: files kept on purpose]
OffloadPolicy(keep_files=True): when the optimizer is closed (collected, or at the process's exit)
its folder stays. Each file is fsync'ed first (so what is kept is on the disk, and a write the
kernel could not put there is found: listed under "errors" in kept.json and warned about, since a
finalizer cannot raise); of the state's two generations the one holding the last applied step is
kept, the other removed; kept.json names each file's tensor, dtype and element count (the files are
flat arrays of that dtype, padded to a page: numpy.fromfile or torch.from_file read them). The lock
is released, and a folder with kept.json is never removed as stale: it is the user's. It is the
last state of a run for reading after it ended (a post-mortem, a comparison); a run continues from a
checkpoint, which holds what these files lack (the layout, the step counts, the loss scale).
"""

from .stores import (
    DeviceState,
    DiskState,
    HostState,
    OffloadError,
    OffloadStats,
    ShardFiles,
    StateSpec,
    file_bytes,
    is_offloaded,
    state_specs,
    window_layout,
)
from .update import OffloadedUpdate, agreed, open_shard_files, open_store, shard_specs

__all__ = [
    "DeviceState",
    "DiskState",
    "HostState",
    "OffloadedUpdate",
    "agreed",
    "open_store",
    "OffloadError",
    "OffloadStats",
    "ShardFiles",
    "StateSpec",
    "open_shard_files",
    "shard_specs",
    "file_bytes",
    "is_offloaded",
    "state_specs",
    "window_layout",
]
