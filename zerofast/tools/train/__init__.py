"""The main job: train a small GPT with ZeroAdam on N local ranks and show ZeRO's memory at work.

    python -m zerofast.train --nproc 2 --stage 3 [--partition flat] [--steps N] [--model tiny|small]
                             [--backend gloo|nccl] [--offload host|disk[:PATH]] [--compare] [--plot memory.png]

Without torchrun's environment it launches itself on --nproc local ranks through
torch.distributed.run (the mechanism behind torchrun), so a multi-machine run is
`torchrun --nnodes ... -m zerofast.train`. Faults: every collective waits at most --timeout seconds;
a dead or stuck rank makes the others exit with one line naming the step, the phase and the
collective; with --max-restarts R and --save-dir, torchrun restarts the workers after a failure and
they resume from the newest checkpoint. --offload keeps ZeroAdam's optimizer state in host memory or
in files on disk (zerofast.OffloadPolicy); the progress bar and the closing table then say where it
lives and what the last step's I/O cost. Trains on text shipped inside the package (zerofast/tools/data.py),
shows a progress bar on rank 0, and ends with a table per rank: parameter, gradient and optimizer
bytes measured next to the ZeRO paper's memory table (Rajbhandari et al., 2020), and the
communication per step next to the paper's 2Φ (stages 1 and 2) / 3Φ (stage 3).

The package, one concern a module: _args (the command line), _launch (starting the ranks), _progress
(rank 0's progress bar), _loop (the training loop and its checkpoints), _report (the memory and
communication table), _plot (the memory plot), _job (one rank's job, the fault exit and main).
"""

from ._args import parse_args
from ._job import exit_on_fault, log, main, worker
from ._launch import launch
from ._loop import run
from ._plot import plot
from ._progress import Progress
from ._report import report

__all__ = ["Progress", "exit_on_fault", "launch", "log", "main", "parse_args", "plot", "report", "run", "worker"]
