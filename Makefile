# zerofast: two commands on a fresh machine.
#   make demo   create .venv, install torch and zerofast, run the main job
#   make test   the same set-up, then the whole test suite
# Overrides: TORCH_SPEC (e.g. TORCH_SPEC="torch==2.11.0" for your own CUDA build), PYTHON (the
# interpreter that creates the venv), ZEROFAST_CUDA (1: build the CUDA kernels, 0: CPU only,
# auto: when torch is a CUDA build and nvcc is found).

PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.14.1
ZEROFAST_CUDA ?= auto
export ZEROFAST_CUDA
# Byte-code: pip installs without compiling every module of every package (--no-compile: torch's and
# transformers' alone cost 13 s of a core), and each module is compiled and cached the first time a
# process imports it. That caching needs PYTHONDONTWRITEBYTECODE unset, which some machines set
# (this one does): with it, every process compiled torch from source anew.
export PYTHONDONTWRITEBYTECODE :=

# Third-party packages. The Hugging Face stack is pinned to the versions zerofast.integrations.hf was
# written and tested against (it hooks the Trainer's and the Accelerator's methods named there; the
# extras in pyproject.toml allow the patch releases of these minor versions, and the integrations
# check their hosts at import): transformers (also the tests' models, built from a config, no
# download), accelerate, peft (LoRA), trl (SFT, DPO, GRPO) and datasets (trl's).
HF_DEPS  := "transformers==5.24.0" "accelerate==1.15.0" "peft==0.21.2" "trl==1.16.0" "datasets==5.2.0"
# Lightning, both packages, for zerofast.integrations.lightning / .pytorch_lightning (ZeroStrategy
# subclasses their DDPStrategy and Precision, written against these versions).
LIGHTNING_DEPS := "lightning==2.6.6" "pytorch-lightning==2.6.6"
# torchft, for zerofast.integrations.torchft (replica groups that survive a lost machine; its Manager,
# ManagedProcessGroup and Lighthouse, written against this version).
FT_DEPS := "torchft==0.2.0"
# Benchmarks only (`make bench`, not the tests): torchao's and bitsandbytes' AdamW8bit, the anchors that
# benchmarks/bench_adam.py runs beside zerofast's 8-bit Adam state.
BENCH_DEPS := "torchao==0.18.0" "bitsandbytes==0.50.2"
# Lint and docs: ruff (Python lint and format), clang-format (csrc/), import-linter (the package's
# layers: pyproject.toml's [tool.importlinter]), mkdocs-material (docs/).
TOOL_DEPS := "ruff==0.17.6" "clang-format==23.1.5" "import-linter==2.17" "mkdocs-material==9.8.2"
PIP_DEPS := "$(TORCH_SPEC)" ninja setuptools wheel pytest pytest-benchmark pytest-xdist numpy matplotlib $(HF_DEPS) $(LIGHTNING_DEPS) $(FT_DEPS) $(TOOL_DEPS)

PY      := $(VENV)/bin/python
# The marker names the package list, so a venv made before a package was added gets it.
DEPS    := $(VENV)/.zerofast-deps-$(shell echo '$(PIP_DEPS)' | cksum | cut -d' ' -f1)
# The build marker names what was built (cuda-1: with the CUDA kernels, cuda-0: without), so that
# ZEROFAST_CUDA=auto accepts whichever build exists (`make demo` after CI's ZEROFAST_CUDA=1 `make
# test` does not rebuild), while an explicit 0 or 1 rebuilds when the build differs.
BUILT_NOW := $(firstword $(wildcard $(VENV)/.zerofast-built-cuda-*))
ifeq ($(ZEROFAST_CUDA),auto)
BUILT   := $(if $(BUILT_NOW),$(BUILT_NOW),$(VENV)/.zerofast-built-cuda-auto)
else
BUILT   := $(VENV)/.zerofast-built-cuda-$(ZEROFAST_CUDA)
endif
SOURCES := $(wildcard csrc/*.cpp csrc/*.h csrc/*.cu) setup.py pyproject.toml

.PHONY: setup build demo test oldest-deps oldest-build test-oldest lint format docs bench cmake clean

setup: $(BUILT)

$(PY):
	$(PYTHON) -m venv $(VENV)

# Third-party packages: installed once; a second `make setup` reuses them.
$(DEPS): | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile $(PIP_DEPS)
	rm -f $(VENV)/.zerofast-deps*
	touch $@

# The benchmarks' anchors, on top of the same venv (their marker names their list, as DEPS's does).
BENCH_MARK := $(VENV)/.zerofast-bench-deps-$(shell echo '$(BENCH_DEPS)' | cksum | cut -d' ' -f1)
$(BENCH_MARK): $(DEPS)
	$(PY) -m pip install --quiet $(BENCH_DEPS)
	rm -f $(VENV)/.zerofast-bench-deps*
	touch $@

# The package itself, editable: rebuilt when a C++/CUDA source or the build files change.
$(BUILT): $(DEPS) $(SOURCES)
	rm -f $(VENV)/.zerofast-built-cuda-*
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $(VENV)/.zerofast-built-cuda-$$($(PY) -c 'import zerofast; print(int(zerofast.has_cuda_kernels()))')

build: $(BUILT)

# The main job: 2 gloo ranks (NCCL with GPUs), ZeroAdam stage 3, then DDP and the reference stage
# for comparison, and the measured memory per rank drawn into memory.png.
demo: $(BUILT)
	$(PY) -m zerofast.train --compare --plot memory.png

# Two pytest-xdist workers, a file at a time each, slowest files first (tests/conftest.py says why).
test: $(BUILT)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests

# The oldest supported torch (zerofast/compat.py holds the range), on the Python of the GPU machine
# the check in scripts/gpu_check.sh is written for (3.12, torch 2.11, transformers 5.17): a venv of its
# own, the extension built in place with the CUDA sources (its file is named by the Python, 3.12's
# beside 3.11's, so the two builds never replace each other), and the subset the GPU check runs
# without a GPU. docs/testing.md says what runs on which torch.
OLDEST_PYTHON ?= $(firstword $(or $(shell command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'print("python3.12")' 2>/dev/null),$(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12)))
OLDEST_TORCH  ?= torch==2.11.0
OLDEST_VENV   ?= .venv-oldest
OLDEST_DEPS   := "$(OLDEST_TORCH)" ninja "setuptools<82" wheel pytest pytest-xdist numpy "transformers==5.17.0"
OLDEST_PY     := $(OLDEST_VENV)/bin/python
OLDEST_MARK   := $(OLDEST_VENV)/.zerofast-deps-$(shell echo '$(OLDEST_DEPS)' | cksum | cut -d' ' -f1)
OLDEST_BUILT  := $(OLDEST_VENV)/.zerofast-built
# The kernels, stages 1-3 against single-process AdamW with a checkpoint resumed (the CUDA-ranks
# file's CPU rehearsal), checkpoints read without running code (DCP's metadata), saved in the
# background (the writer's own group: torch<=2.13's group names) and written through DCP's
# checkpointable protocol (ChunkedTensor) in the format older checkpoints have, clean exits, tensor
# parallelism (it relinks DTensors through their _local_tensor and swap_tensors), and the GPU check's
# dry run (its preflight, the collection of the CUDA tests) on the GPU machine's torch.
OLDEST_TESTS  := tests/test_fused_adam.py tests/test_quant_state.py tests/test_cuda_ranks.py \
                 tests/test_checkpoint_safe.py tests/test_checkpoint_async.py tests/test_checkpoint_format.py \
                 tests/test_exit.py tests/test_torch_model.py tests/test_tensor_parallel.py::test_tp2_dp2_equals_adamw_on_the_global_batch \
                 tests/test_gpu_check.py::test_gpu_check_dry_run_goes_through_every_step

$(OLDEST_PY):
	@test -n "$(OLDEST_PYTHON)" || { echo "make test-oldest: no Python 3.12 found (the GPU machine's); set OLDEST_PYTHON" >&2; exit 1; }
	$(OLDEST_PYTHON) -m venv $(OLDEST_VENV)

$(OLDEST_MARK): | $(OLDEST_PY)
	$(OLDEST_PY) -m pip install --quiet --upgrade pip
	$(OLDEST_PY) -m pip install --quiet --no-compile $(OLDEST_DEPS)
	rm -f $(OLDEST_VENV)/.zerofast-deps*
	touch $@

oldest-deps: $(OLDEST_MARK)
oldest-build: $(OLDEST_BUILT)

$(OLDEST_BUILT): $(OLDEST_MARK) $(SOURCES)
	$(OLDEST_PY) setup.py --quiet build_ext --inplace
	touch $@

test-oldest: $(OLDEST_BUILT)
	$(OLDEST_PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder $(OLDEST_TESTS)

# Lint: ruff's linter and formatter (pyproject.toml's [tool.ruff]), clang-format (.clang-format) over
# csrc/, checking only (`make format` rewrites the tree the same way), and import-linter's contracts
# (pyproject.toml's [tool.importlinter]: the layers, and no core module importing an integration or a
# command line).
CXX_SOURCES := $(wildcard csrc/*.cpp csrc/*.h csrc/*.cu)
lint: $(DEPS)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror $(CXX_SOURCES)
	$(VENV)/bin/lint-imports --no-cache

format: $(DEPS)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $(CXX_SOURCES)

# The documentation (mkdocs.yml, docs/): built with --strict, so a broken link, anchor or nav entry
# fails, into site/ (git-ignored). tests/test_docs.py runs the same build. NO_MKDOCS_2_WARNING quiets
# mkdocs-material's banner about MkDocs 2.0, which is not a warning about these pages.
docs: $(DEPS)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

bench: $(BUILT) $(BENCH_MARK)
	$(PY) -m pytest -q benchmarks --benchmark-only --benchmark-columns=min,median,max,rounds

# The same sources built by CMake against torch's CMake package (IDEs, sanitizers); see CMakeLists.txt.
cmake: $(DEPS)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" cmake -S . -B build-cmake/cpu -G Ninja \
	  -DCMAKE_PREFIX_PATH="$$($(PY) -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
	  -DPython3_EXECUTABLE="$(CURDIR)/$(PY)"
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" cmake --build build-cmake/cpu -j2

clean:
	rm -rf build build-cmake site zerofast/_C*.so *.egg-info $(VENV)/.zerofast-built-cuda-*
