"""Build zerofast._C with torch.utils.cpp_extension (ninja).

CPU sources always; CUDA sources when ZEROFAST_CUDA=1, or when ZEROFAST_CUDA is unset/"auto" and
torch is a CUDA build and an nvcc of the same CUDA major version is found ($CUDA_HOME/bin, PATH or
/usr/local/cuda/bin: scripts/cuda_toolkit.py). ZEROFAST_CUDA=0 forces a CPU-only build.
"""

import glob
import os
import subprocess
import sys

from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"  # relative: setuptools refuses absolute source paths when it builds a wheel


def _load_by_path(name: str, *parts: str):
    """A module of this checkout loaded from its file, without importing the package around it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, *parts))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_torch():
    """zerofast/compat.py's supported range, checked before anything is compiled: a torch outside it
    is one sentence naming the range, never a compile error."""
    import torch

    _load_by_path("zerofast_compat", "zerofast", "compat.py").check_torch(torch.__version__, error=SystemExit)


def _toolkit_module():
    """scripts/cuda_toolkit.py: where nvcc is looked for, and the CUDA version check."""
    return _load_by_path("cuda_toolkit", "scripts", "cuda_toolkit.py")


def _cuda_wanted():
    """Decide whether to build the CUDA sources; fail at once when asked for and impossible."""
    mode = os.environ.get("ZEROFAST_CUDA", "auto").strip().lower()
    if mode not in ("0", "1", "auto", ""):
        sys.exit(f"zerofast: ZEROFAST_CUDA must be 0, 1 or auto; got {mode!r}")
    if mode == "0":
        return False
    toolkit = _toolkit_module()
    found = toolkit.probe()
    problem = found.problem()
    if problem is not None:
        if mode == "1":
            sys.exit(f"zerofast: ZEROFAST_CUDA=1 but {problem}")
        if found.nvcc is not None and found.torch_version is not None:  # both there, but they don't match
            print(f"zerofast: building without the CUDA kernels: {problem}", file=sys.stderr)
        return False
    cuda_home = toolkit.real_cuda_home(found.nvcc)
    os.environ["CUDA_HOME"] = cuda_home
    cpp_extension.CUDA_HOME = cuda_home  # read at import time; refresh it
    return True


def _compiler_is_gcc() -> bool:
    """Whether the C++ compiler cpp_extension runs ($CXX, else c++) is GCC, not clang posing as it."""
    try:
        out = subprocess.run(
            [os.environ.get("CXX", "c++"), "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True
        ).stdout
    except OSError:
        return False
    return "__GNUC__" in out and "__clang__" not in out


def _extension():
    _check_torch()
    with_cuda = _cuda_wanted()
    os.chdir(ROOT)
    sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")))
    # -ffp-contract=off: the math says where it fuses multiply-adds (see adam_math.h); the compiler
    # must not add more, or results drift from torch.optim.AdamW by an ulp.
    # -fopenmp: at::parallel_for is inline in ATen's headers and is a `#pragma omp parallel` in
    # OpenMP builds of torch; without the flag it silently runs on one thread (measured: 42 ms vs
    # torch's 25-33 ms for 50M elements on 2 threads).
    cxx = ["-O3", "-fno-math-errno", "-fopenmp", "-ffp-contract=off"]
    # GCC's generic tuning emulates gathers with scalar loads; the 8-bit step's table lookups
    # (adam_cpu_loop.h) run 11% faster with the AVX-512 gather instructions (measured, 20M elements,
    # one thread: 83 -> 74 ms). A tuning choice only: the same values either way. Clang lacks the flag.
    if _compiler_is_gcc():
        cxx.append("-mtune-ctrl=use_gather")
    # -g0: Python's CFLAGS carry -g, and debug information costs these template-heavy translation
    # units a third to half of their compile time (measured: ops.cpp 63 -> 42 s, bucket_layout.cpp
    # 19 -> 9 s). ZEROFAST_DEBUG_INFO=1 keeps it, for a debugger or a symbolized crash. For the same
    # reason the sources include <ATen/core/Tensor.h> and the per-operator headers they call
    # (<ATen/ops/empty.h>), not <ATen/ATen.h> (7 s of parsing per translation unit), and bindings.cpp
    # <torch/python.h>, not <torch/extension.h> (which adds the whole C++ frontend): the build's
    # compile time went from 275 to 133 CPU seconds.
    if os.environ.get("ZEROFAST_DEBUG_INFO") != "1":
        cxx.append("-g0")
    include_dirs = [os.path.join(ROOT, CSRC)]
    macros = []
    if not with_cuda:
        return cpp_extension.CppExtension(
            "zerofast._C",
            sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"],
        )
    sources += sorted(glob.glob(os.path.join(CSRC, "*.cu")))
    macros.append(("ZEROFAST_WITH_CUDA", None))
    # ATen's CUDA headers include cusparse.h, which pip's CUDA wheels put beside torch.
    for site in sys.path:
        extra = os.path.join(site, "nvidia", "cu13", "include")
        if os.path.isdir(extra):
            include_dirs.append(extra)
            break
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    nvcc_flags = ["-O3", "-lineinfo", "--fmad=false"]
    return cpp_extension.CUDAExtension(
        "zerofast._C",
        sources,
        include_dirs=include_dirs,
        define_macros=macros,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc_flags},
        extra_link_args=["-fopenmp"],
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
