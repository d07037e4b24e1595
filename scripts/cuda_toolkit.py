"""Find the CUDA toolkit that zerofast's CUDA kernels are built with, and check it against torch.

Used by setup.py (the build) and scripts/gpu_check.sh (its preflight). Standalone (the standard
library and torch only), because the build runs before zerofast is importable.

    python scripts/cuda_toolkit.py     # prints nvcc's path and both CUDA versions; exit 1 if unusable

Where nvcc is looked for, first found wins: $CUDA_HOME/bin/nvcc, nvcc on PATH, /usr/local/cuda/bin/nvcc
(where NVIDIA's installers and the CUDA containers put it, often not on PATH). torch refuses to build
an extension whose CUDA major version differs from its own (the two runtimes would both be loaded);
the check here says so before the build starts, naming both versions.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from typing import NamedTuple

FALLBACK_NVCC = "/usr/local/cuda/bin/nvcc"


class Toolkit(NamedTuple):
    nvcc: str | None  # the nvcc found, or None
    where: str  # how it was found ("$CUDA_HOME", "PATH", "/usr/local/cuda"), or where it was looked for
    nvcc_version: str | None  # "13.0" from `nvcc --version`, None when it could not be read
    torch_version: str | None  # torch.version.cuda (None: a CPU-only torch)

    def problem(self) -> str | None:
        """Why the CUDA kernels cannot be built with this toolkit and torch (None: they can)."""
        if self.torch_version is None:
            return "torch is a CPU-only build (torch.version.cuda is None)"
        if self.nvcc is None:
            return f"nvcc was not found ({self.where})"
        if self.nvcc_version is None:
            return f"`{self.nvcc} --version` did not say its CUDA release"
        if major(self.nvcc_version) != major(self.torch_version):
            return (
                f"nvcc {self.nvcc} is CUDA {self.nvcc_version} but torch was built with CUDA "
                f"{self.torch_version}: the major versions must match (set CUDA_HOME to a CUDA "
                f"{major(self.torch_version)}.x toolkit)"
            )
        return None


def major(version: str) -> int:
    return int(version.split(".")[0])


def find_nvcc() -> tuple[str | None, str]:
    """(path, how it was found), or (None, where it was looked for)."""
    cuda_home = os.environ.get("CUDA_HOME")
    if cuda_home and os.path.isfile(os.path.join(cuda_home, "bin", "nvcc")):
        return os.path.join(cuda_home, "bin", "nvcc"), "$CUDA_HOME"
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path, "PATH"
    if os.path.isfile(FALLBACK_NVCC) and os.access(FALLBACK_NVCC, os.X_OK):
        return FALLBACK_NVCC, "/usr/local/cuda"
    looked = "on PATH and in /usr/local/cuda/bin"
    if cuda_home:
        looked = f"in $CUDA_HOME/bin ({cuda_home}/bin), " + looked
    return None, looked


def nvcc_release(nvcc: str) -> str | None:
    """ "13.0" from nvcc's "Cuda compilation tools, release 13.0, V13.0.48"."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+)\.(\d+)", out)
    return f"{found.group(1)}.{found.group(2)}" if found else None


def probe() -> Toolkit:
    import torch

    nvcc, where = find_nvcc()
    return Toolkit(nvcc, where, nvcc_release(nvcc) if nvcc else None, torch.version.cuda)


def real_cuda_home(nvcc: str) -> str:
    """The toolkit folder whose bin/ holds the real nvcc.

    nvcc on PATH may be a small wrapper script that execs the real one (`exec /x/bin/nvcc "$@"`);
    torch would take the wrapper's prefix as CUDA_HOME and then find no libcudart there.
    """
    real = os.path.realpath(nvcc)
    try:
        with open(real, "rb") as f:
            head = f.read(4096)
        if head.startswith(b"#!"):
            for token in head.decode(errors="replace").split():
                token = token.strip("\"'")
                if token.endswith("/nvcc") and os.path.isfile(token) and token != real:
                    real = os.path.realpath(token)
                    break
    except OSError:
        pass
    return os.path.dirname(os.path.dirname(real))


def main() -> int:
    tk = probe()
    print(f"nvcc: {tk.nvcc or 'not found'} ({tk.where})")
    print(f"nvcc CUDA: {tk.nvcc_version or '-'}   torch CUDA: {tk.torch_version or '- (CPU-only torch)'}")
    problem = tk.problem()
    if problem:
        print(f"unusable: {problem}")
        return 1
    print(f"usable: CUDA_HOME={real_cuda_home(tk.nvcc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
