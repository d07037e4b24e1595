"""step_time: a step-time model for ZeRO stages 1-3, flat or hybrid (shard_size=K), with or without
tensor parallelism: the bytes estimate_traffic counts, priced per collective on the link it crosses
(collective_time, link_of), against the step's compute. Pure arithmetic, like the memory estimator.

[Note: the time model]
Collectives (n ranks in the group, B payload bytes as report().comm counts them, c calls, a link
of bus bandwidth bw per GPU and latency alpha per hop; the ring algorithms NCCL uses for large
messages, the "bus bandwidth" convention of nccl-tests):
  all_reduce                   2 (n-1)/n * B/bw + c * 2 (n-1) * alpha
  reduce_scatter, all_gather     (n-1)/n * B/bw + c *   (n-1) * alpha
  broadcast, reduce            B/bw + c * (n-1) * alpha   (pipelined chain: every byte leaves the
                               root once; an owner layout's broadcasts from each owner add up to B)
plus, for the reducing ones (all_reduce, reduce_scatter, reduce), (n-1)/n * B / reduce_rate: the
arithmetic of the reduction (the alpha-beta-gamma model; infinite by default, as a GPU's reduction
runs far above link speed, but a CPU's single thread does not: scripts/probe_links.py fits it).
Links: the ranks are numbered node by node (torchrun), G GPUs per node. A group whose ranks all
sit on one node uses the intra-node link (NVLink); any other ring crosses nodes and is bound by the
inter-node link (each GPU's own NIC; the ring's hops are all priced at the slower link's latency).
Flat ZeRO over W > G ranks therefore runs every collective at inter-node speed; hybrid with K = G
keeps the shard group's reduces and gathers on NVLink and sends only the replicate all_reduce of
1/K of the gradient across nodes (one ring per GPU index, through that GPU's NIC).
Compute: 6 * params * tokens FLOPs per step (2 forward, 4 backward) at the achieved FLOP rate, plus
the Adam update of this rank's shard (bytes per element over memory bandwidth).
Overlap: the shard group's reduces and the replicate all_reduce of each bucket's owned range
(launched as the bucket's reduce finishes) run while backward computes, stage 3's forward gathers
while forward computes (prefetch) and its backward gathers while backward computes: each phase
exposes max(0, its communication - its compute), the phase's collectives counted one after another
even where they use different links (a bound from above). The agreement and stages 1-2's parameter
gather (after the update; overlap_param_gather is not modelled) are exposed whole. Not modelled: the
first unit's gather and the last bucket's reduce, which no compute hides; contention between a
phase's collectives and its compute for memory bandwidth; NCCL's tree algorithms (which cut the
latency term to log n at large n); compute that does not scale as 6 * params * tokens (attention at
long sequences).
With overlap=False every collective is exposed (a machine whose communication and compute share
the same cores: gloo ranks on a CPU machine).

[Note: tensor parallelism in the time model]
With tp = N (step_time's tp; zerofast/tensor_parallel.py trains so), a tp group is N consecutive
ranks, which see the same tokens and each hold 1/N of every split weight:
  - ZeRO runs over the W/N data-parallel ranks of each tp coordinate, on a rank's ceil(Φ/N)
    elements: traffic_ops(ceil(Φ/N), W/N, ...). Those ranks are r, r + N, r + 2N, ...: flat, their
    ring stays on one node only if the whole world does, else it crosses nodes. With hybrid sharding
    (shard_size K counts data-parallel ranks, as ZeroAdam's mesh dim "dp") a shard group is K of them,
    within one block of K * N consecutive ranks: on one node when that block divides a node; the
    replicas, every (K * N)-th rank, cross nodes unless the world fits one.
  - Each layer's activations cross the tp group (Megatron's tensor parallelism: Shoeybi et al.
    2019; with sequence parallelism, Korthikanti et al. 2022): in forward an all_reduce of the
    attention's and of the MLP's row-parallel output, in backward one of each column-parallel
    input's gradient, each of tokens x hidden activations in the parameters' dtype, where tokens
    is the tp group's (N times a GPU's share of the global batch). Sequence parallelism turns each
    into a reduce_scatter and an all_gather of the same bytes, which the ring prices the same. They
    sit between a layer's matmuls, so they are exposed whole. Not counted: the embedding's
    all_reduce and the head's gather of the logits (once per step, not per layer), and
    communication overlapped inside a layer (async TP).
  - Their link: intra-node when N divides G (a machine's GPUs), else inter-node.
  - Compute: a GPU computes 1/N of every matmul of its tp group's tokens: 6 * Φ * tokens per GPU, as
    without tensor parallelism for the same global batch; the update streams its ZeRO shard of Φ/N.

[Note: pipeline parallelism in the time model]
With pp = P (step_time's pp; zerofast/pipelining.py trains so), "pp" outermost: a stage's ranks are
W/P consecutive ones, each holding ceil(Φ/P) parameters (an even cut), and the P stages of one
data-parallel replica (P * tp GPUs) see its tokens, P * tp times a GPU's share of the global batch,
in M micro-batches (the schedule's n_microbatches):
  - ZeRO runs within a stage exactly as over a world of W/P ranks (tensor parallelism inside it as
    above, with the stage's ceil(layers/P) layers), but once a step whatever M ([Note: pipeline
    accumulation]): one reduce, stage 3's units gathered once (the parts kept gathered for the step,
    the default). The reduce overlaps the last micro-batch's backward only, stage 3's gathers the
    first micro-batch's forward: each phase's window is 1/M of its compute. The step's agreement and
    statistics all_reduce over "pp" (traffic_ops' "pp" ops), exposed whole.
  - The bubble: a stage idles while the pipeline fills and drains, (P - 1) / (V * M) of its forward and
    backward compute (GPipe and 1F1B: Narayanan et al. 2021; V stages per rank, interleaved: the bubble
    shrinks V times). The zero-bubble schedules fill part of it with weight passes: this bounds them
    from above.
  - Point to point: each micro-batch's activations (its tokens x hidden, in the parameters' dtype) go
    forward across every stage boundary and their gradients back, on each tp rank (torch's stages send
    the whole local tensor): 2 * V * M transfers a GPU a step, counted as sent bytes on the "pp" link
    (peers W/P ranks apart: intra-node only if the whole world is one node). They overlap the other
    micro-batches' compute but for the fill and the drain, 2 * (P * V - 1) transfers on the critical
    path, exposed; with overlap=False all of them.
  - Compute: 6 * Φ * tokens per GPU as without pipelining (a GPU computes 1/P of the layers for P
    times the tokens), plus the bubble.
Not modelled: activation memory (M micro-batches in flight), an uneven cut (the embedding and the
head on the end stages), and the stage-3 policy that gathers per micro-batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..config import CommPolicy, resolve_plan
from ..topology import check_shard_size
from .traffic import Op, traffic_ops


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s, bus bandwidth per GPU
    latency: float  # seconds per hop
    reduce_rate: float = float("inf")  # bytes/s of the reduction arithmetic (the model's gamma; GPUs: no cost)


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int = 8
    intra: Link = Link("intra-node", 300e9, 5e-6)  # NVLink: ~300 GB/s bus bandwidth per GPU
    inter: Link = Link("inter-node", 400e9 / 8, 10e-6)  # a 400 Gb/s NIC per GPU
    flops: float = 400e12  # achieved FLOP/s per GPU (about 40% of an H100's dense bf16 peak)
    update_bandwidth: float = 2e12  # bytes/s the Adam update streams (HBM, below its ~3.3 TB/s peak)
    update_bytes: int = 32  # bytes read and written per owned element (master, m, v, grad, param)


def collective_time(name: str, nbytes: float, calls: int, ranks: int, link: Link) -> float:
    """Seconds for `calls` collectives of kind `name` moving `nbytes` in all over `ranks` ranks:
    [Note: the time model]. A group of one moves nothing."""
    n = ranks
    if n <= 1 or (nbytes <= 0 and calls <= 0):
        return 0.0
    base = name.split("/")[-1]
    gamma = (n - 1) / n * nbytes / link.reduce_rate
    if base.startswith("all_reduce"):
        return 2 * (n - 1) / n * nbytes / link.bandwidth + calls * 2 * (n - 1) * link.latency + gamma
    if base in ("reduce_scatter", "all_gather"):
        return (
            (n - 1) / n * nbytes / link.bandwidth
            + calls * (n - 1) * link.latency
            + (gamma if base == "reduce_scatter" else 0.0)
        )
    if base in ("broadcast", "reduce"):
        return nbytes / link.bandwidth + calls * (n - 1) * link.latency + (gamma if base == "reduce" else 0.0)
    raise ValueError(f"collective_time: no cost model for the collective {name!r}")


def link_of(group: str, world: int, shard_size: int, cluster: Cluster, tp: int = 1) -> Link:
    """The link a group's ring is bound by: intra-node if every rank of the group is on one node.
    tp > 1: the ranks of a "tp" group are consecutive, those of the data-parallel ("shard") groups
    every tp-th, shard_size of them ([Note: tensor parallelism in the time model])."""
    g = cluster.gpus_per_node
    if group == "tp":
        one_node = tp <= g and g % tp == 0
    elif group == "shard" and tp > 1:  # K data-parallel ranks in a block of K * tp consecutive ones
        block = shard_size * tp
        one_node = world <= g or (block <= g and g % block == 0)
    elif group == "shard":  # K consecutive ranks, starting at a multiple of K
        one_node = shard_size <= g and g % shard_size == 0
    else:  # ranks r, r + K, r + 2K, ...: on one node only if the whole world is
        one_node = world <= g
    return cluster.intra if one_node else cluster.inter


@dataclass
class StepTime:
    compute: float  # forward + backward + update, seconds
    forward: float
    backward: float
    update: float
    comm: dict[str, float]  # seconds of communication per link name
    bytes: dict[str, int]  # bytes per step per link name (this rank)
    exposed: float  # communication not hidden behind compute
    phases: dict[str, float] = field(default_factory=dict)  # communication seconds per phase
    bubble: float = 0.0  # pipeline parallelism: seconds a stage idles while the pipeline fills and drains

    @property
    def step(self) -> float:
        return self.compute + self.exposed + self.bubble


def predict(
    ops: list[Op],
    world: int,
    shard_size: int,
    cluster: Cluster,
    forward: float,
    backward: float,
    update: float,
    overlap: bool = True,
    tp: int = 1,
) -> StepTime:
    """Step time from the step's collectives (traffic_ops, and tp_ops with tensor parallelism) and its
    compute: [Note: the time model]. The "tp" group's collectives are exposed whole ([Note: tensor
    parallelism in the time model]); phases["tp"] holds their seconds."""
    comm: dict[str, float] = {}
    nbytes: dict[str, int] = {}
    phases = {"forward": 0.0, "backward": 0.0, "step": 0.0}
    tp_time = 0.0
    for op in ops:
        link = link_of(op.group, world, shard_size, cluster, tp)
        t = collective_time(op.name, op.nbytes, op.calls, op.ranks, link)
        comm[link.name] = comm.get(link.name, 0.0) + t
        nbytes[link.name] = nbytes.get(link.name, 0) + op.nbytes
        if op.group == "tp":
            tp_time += t
        else:
            phases[op.phase] += t
    if overlap:
        exposed = max(0.0, phases["forward"] - forward) + max(0.0, phases["backward"] - backward) + phases["step"]
    else:
        exposed = sum(phases.values())
    if tp > 1:
        phases["tp"] = tp_time
    return StepTime(forward + backward + update, forward, backward, update, comm, nbytes, exposed + tp_time, phases)


def tp_ops(layers: int, hidden: int, tokens: int, tp: int, act_bytes: int) -> list[Op]:
    """The activations' collectives of one step on a tp group of `tp` ranks: per layer two all_reduces
    of tokens x hidden activations (act_bytes each) in forward and two in backward; tokens: the tp
    group's ([Note: tensor parallelism in the time model]). None for tp = 1."""
    if tp <= 1:
        return []
    nbytes = 2 * layers * tokens * hidden * act_bytes
    return [Op("tp", "all_reduce", nbytes, 2 * layers, phase, tp) for phase in ("forward", "backward")]


def compute_times(
    params: int, tokens: int, world: int, shard_size: int, stage: int, cluster: Cluster
) -> tuple[float, float, float]:
    """(forward, backward, update) seconds per step on one GPU: 2 and 4 FLOPs per parameter per
    token, and the Adam update of this rank's 1/K of the elements (all of them without sharding)."""
    flops = 6 * params * tokens
    update = (params / shard_size if stage >= 1 else params) * cluster.update_bytes / cluster.update_bandwidth
    return flops / 3 / cluster.flops, 2 * flops / 3 / cluster.flops, update


def step_time(
    params: int,
    world: int,
    stage: int,
    tokens: int,
    shard_size=None,
    cluster: Cluster = Cluster(),
    mixed_precision="bf16",
    backend: str = "nccl",
    micro_batches: int = 1,
    overlap: bool = True,
    model=None,
    comm=None,
    tp: int = 1,
    layers: int | None = None,
    hidden: int | None = None,
    pp: int = 1,
    stages_per_rank: int = 1,
) -> StepTime:
    """The predicted step of `params` parameters (or of `model`, exactly, when given) on `world`
    GPUs, `tokens` tokens per GPU per step (the global batch over `world`). tp: the tensor-parallel
    degree, with the model's `layers` and `hidden` size, whose activations cross the tp links
    ([Note: tensor parallelism in the time model]); ZeRO over the rest (shard_size: K of the world/tp
    data-parallel ranks to a shard), a count of parameters. pp: pipeline stages over `micro_batches`
    micro-batches (stages_per_rank: interleaved schedules), with the model's `hidden` size, whose
    activations cross the stage boundaries ([Note: pipeline parallelism in the time model])."""
    if pp != 1:
        return _pp_step_time(
            params, world, stage, tokens, shard_size, cluster, mixed_precision, backend, micro_batches, overlap,
            model, comm, tp, layers, hidden, pp, stages_per_rank,
        )  # fmt: skip
    if tp != 1:
        return _tp_step_time(
            params, world, stage, tokens, shard_size, cluster, mixed_precision, backend, micro_batches, overlap,
            model, comm, tp, layers, hidden,
        )  # fmt: skip
    k = world if shard_size is None else shard_size
    ops = traffic_ops(
        model if model is not None else params,
        world,
        stage,
        mixed_precision=mixed_precision,
        comm=_sharded(comm, k),
        backend=backend,
        micro_batches=micro_batches,
    )
    fwd, bwd, upd = compute_times(params, tokens, world, k, stage, cluster)
    return predict(ops, world, k, cluster, fwd, bwd, upd, overlap)


def _tp_step_time(
    params, world, stage, tokens, shard_size, cluster, mixed_precision, backend, micro_batches, overlap, model, comm,
    tp, layers, hidden,
) -> StepTime:  # fmt: skip
    """step_time with tensor parallelism: [Note: tensor parallelism in the time model]."""
    who = "step_time"
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world % tp:
        raise ValueError(f"{who}: tp must be an integer >= 1 that divides world ({world}); got {tp!r}")
    for name, value in (("layers", layers), ("hidden", hidden)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{who}: tp > 1 needs the model's {name} (an integer >= 1: the tp links carry each layer's "
                f"tokens x hidden activations); got {name}={value!r}"
            )
    if model is not None:
        raise ValueError(f"{who}: with tp > 1 the model is a count of parameters; got model={type(model).__name__}")
    dp = world // tp
    k = check_shard_size(shard_size, dp, f"{who} with tp={tp} (over its {dp} data-parallel ranks)", comm)
    local = -(-params // tp)
    ops = traffic_ops(
        local,
        dp,
        stage,
        mixed_precision=mixed_precision,
        comm=_sharded(comm, k),
        backend=backend,
        micro_batches=micro_batches,
    )
    act_bytes = resolve_plan(stage, mixed_precision=mixed_precision).param_dtype.itemsize  # the activations' dtype
    ops += tp_ops(layers, hidden, tokens * tp, tp, act_bytes)
    flops = 6 * params * tokens
    update = (local / k if stage >= 1 else local) * cluster.update_bytes / cluster.update_bandwidth
    return predict(
        ops, world, k, cluster, flops / 3 / cluster.flops, 2 * flops / 3 / cluster.flops, update, overlap, tp
    )


def _pp_step_time(
    params, world, stage, tokens, shard_size, cluster, mixed_precision, backend, micro_batches, overlap, model, comm,
    tp, layers, hidden, pp, v,
) -> StepTime:  # fmt: skip
    """step_time with pipeline parallelism: [Note: pipeline parallelism in the time model]."""
    who = "step_time"
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1 or world % pp:
        raise ValueError(f"{who}: pp must be an integer >= 1 that divides world ({world}); got {pp!r}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or (world // pp) % tp:
        raise ValueError(f"{who}: tp must be an integer >= 1 that divides world / pp ({world // pp}); got {tp!r}")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{who}: stages_per_rank must be an integer >= 1; got {v!r}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < pp:
        raise ValueError(
            f"{who}: micro_batches must be an integer >= pp ({pp}: a pipeline runs one micro-batch a stage at "
            f"once); got {micro_batches!r}"
        )
    for name, value, needed in (("hidden", hidden, True), ("layers", layers, tp > 1)):
        if needed and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(
                f"{who}: pp > 1 needs the model's {name} (an integer >= 1: each micro-batch's tokens x hidden "
                f"activations cross the stage boundaries{', and each layer the tp links' if tp > 1 else ''}); "
                f"got {name}={value!r}"
            )
    if model is not None:
        raise ValueError(f"{who}: with pp > 1 the model is a count of parameters; got model={type(model).__name__}")
    m, part, stage_world = micro_batches, -(-params // pp), world // pp
    dp = stage_world // tp
    k = check_shard_size(shard_size, dp, f"{who} with pp={pp} (over a stage's {dp} data-parallel ranks)", comm)
    ops = traffic_ops(
        part, world, stage, mixed_precision=mixed_precision, comm=_sharded(comm, k), backend=backend, tp=tp, pp=pp
    )  # once a step ([Note: pipeline accumulation]), and the step's all_reduces over "pp"
    act_bytes = resolve_plan(stage, mixed_precision=mixed_precision).param_dtype.itemsize
    replica_tokens = tokens * pp * tp
    if tp > 1:
        ops += tp_ops(-(-layers // pp), hidden, replica_tokens, tp, act_bytes)
    flops = 6 * part * tokens * pp  # 6 * Φ * tokens per GPU, up to the cut's rounding
    fwd, bwd = flops / 3 / cluster.flops, 2 * flops / 3 / cluster.flops
    local = -(-part // tp)
    update = (local / k if stage >= 1 else local) * cluster.update_bytes / cluster.update_bandwidth
    pp_link = cluster.intra if world <= cluster.gpus_per_node else cluster.inter
    on_pp = [op for op in ops if op.group == "pp"]
    t = predict(
        [op for op in ops if op.group != "pp"], stage_world, k, cluster, fwd / m, bwd / m, update, overlap, tp
    )  # the windows: the last micro-batch's backward, the first's forward
    comm_s, nbytes = dict(t.comm), dict(t.bytes)
    flags = sum(collective_time(op.name, op.nbytes, op.calls, op.ranks, pp_link) for op in on_pp)
    one = replica_tokens // m * hidden * act_bytes  # a micro-batch's activations (or their gradient)
    transfer = one / pp_link.bandwidth + pp_link.latency
    p2p = 2 * v * m * transfer
    exposed_p2p = 2 * (pp * v - 1) * transfer if overlap else p2p
    comm_s[pp_link.name] = comm_s.get(pp_link.name, 0.0) + flags + p2p
    nbytes[pp_link.name] = nbytes.get(pp_link.name, 0) + sum(op.nbytes for op in on_pp) + 2 * v * m * one
    return dataclasses.replace(
        t,
        compute=fwd + bwd + update,
        forward=fwd,
        backward=bwd,
        comm=comm_s,
        bytes=nbytes,
        exposed=t.exposed + flags + exposed_p2p,  # predict's over the micro-batch windows, and the pipeline's
        phases={**t.phases, "pp": flags + p2p},
        bubble=(pp - 1) / (v * m) * (fwd + bwd),
    )


def _sharded(comm, shard_size: int) -> CommPolicy:
    """comm (None: the defaults) with its shard_size set: how traffic_ops takes hybrid sharding."""
    return dataclasses.replace(comm if comm is not None else CommPolicy(), shard_size=shard_size)
