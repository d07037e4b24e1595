"""The model stays a torch model: what torch's own calls see of a parameter zerofast manages.

[Note: the model stays a torch model]
The optimizer makes each managed parameter a view of its flat buffers (zerofast/layout.py
bind_views), and stage 3 frees a unit's buffer between uses. Left alone, the calls a user makes on
the model after building the optimizer would read freed memory (stage 3), be undone by the next
step (a write the fp32 master never saw), silently detach a parameter from its buffer (`.to()`,
`.double()`), or act on gradients that are not there (torch.nn.utils.clip_grad_norm_ at stages 2
and 3). So each managed parameter has a ParamSlot (params.py) that says where its values are, and:
  - values: a parameter is in its own class (no cost on any op) while its values are on this rank:
    stages 1 and 2 always, stage 3 while its unit is gathered (forward, backward,
    gathered_params()). Between uses at stage 3 it is moved to a guarded subclass of its class
    (params.py) whose __torch_function__ lets metadata through (shape, dtype, device,
    requires_grad, names: what the plain model has), applies in-place writes to this rank's shard
    (copy_, nn.init.*_, fill_, mul_, ...: elementwise, so each rank writes its own pieces with no
    collective; load_state_dict is a copy_ per parameter), and raises ShardedParameterError, naming
    opt.gathered_params(), for any read of the values. No read ever reaches freed storage.
  - the fp32 master follows what the model holds: stages 1 and 2 compare the low-precision
    parameters with the master's rounding before a step and before the state is read (a
    checkpoint), and take the written elements (ShardState.follow_params); stage 3's writes reach
    the shard and the master directly, and gathered_params() keeps what was written inside it
    (UnitBuffers.keep_writes). A write is what the plain model would hold: in bf16 the bf16 value,
    whose fp32 is the master's.
  - gradients: from the end of a step's last backward to step(), a managed parameter's `.grad`
    reads as a ShardedGrad (grads.py): the reduced gradient, of which each rank holds its shard.
    torch.nn.utils.clip_grad_norm_ and clip_grad_value_ work on it (norms are the global norms,
    one small all_reduce, so every rank calls them, as it calls step(); scaling and clamping act on
    each rank's shard); any other read raises ShardedGradientError. Stages 1 and 2 move their
    parameters to the guarded class for that window only (nothing runs on them then but the user's
    calls), stage 3's are there anyway.
  - the module: every module that holds a managed parameter (and the root) moves to a subclass of
    its class (modules.py, with the stage-3 hook classes of zerofast/_hook_classes.py) whose
    _apply lets a conversion that changes nothing for the managed parameters through (model.to()
    where the model is, .float() on an fp32 model: Accelerate's prepare) and raises
    ModelConversionError before anything changes otherwise; whose state_dict at stage 3 gives whole
    copies inside gathered_params() and a named error outside it (the values are on no one rank);
    and which refuses load_state_dict(assign=True) and a managed parameter replaced by another.
What is not covered: a view taken of a stage-3 parameter inside forward (a hook that keeps
`weight.detach()`) and read after its unit was released; views taken inside gathered_params() are
safe (the block's exit leaves escaped storage to them: UnitBuffers.keep_writes). Tensor-parallel
(DTensor) parameters are not guarded.
"""
