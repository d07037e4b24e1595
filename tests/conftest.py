import os
import sys

# Let spawned ranks import the test helpers (tests/ is on sys.path under pytest's default import mode).
sys.path.insert(0, os.path.dirname(__file__))

# `make test` runs the files on two pytest-xdist workers, a file at a time each (--dist loadfile
# --no-loadscope-reorder: in this order). Most of the slow files launch processes and then wait on
# them (process start-up, a process group's timeout, a heartbeat), which leaves a core free for the
# other worker. The slowest files go first, so that the run does not end on one of them with the
# other worker idle: longest first; the rest keep pytest's order. The order changes how long the
# run takes, never what it tests.
SLOWEST_FIRST = (  # by their time in `make test` (2-vCPU EPYC, 2026-12-05; --durations=0, summed by file)
    "test_train.py",
    "test_launch.py",
    "test_torchft.py",
    "test_pipelining.py",
    "test_compile.py",
    "test_checkpoint.py",
    "test_hf.py",
    "test_lightning.py",
    "test_tensor_parallel.py",
    "test_rl.py",
    "test_zero_adam.py",
    "test_hybrid.py",
    "test_precision.py",
    "test_gpu_check.py",
    "test_accelerate.py",
    "test_offload_params.py",
    "test_faults.py",
    "test_stage3.py",
    "test_offload.py",
    "test_buffers.py",
    "test_estimate.py",
    "test_grad_path.py",
    "test_exit.py",
    "test_torch_model.py",
    "test_harness.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(item.path), len(rank)))  # stable: the rest keep their order
