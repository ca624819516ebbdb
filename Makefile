# The README's two commands: `make demo` and `make test`. Both set up .venv on a
# fresh machine (pinned dependencies), build the op library and run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_REQ ?= requirements/torch.txt
STAMP := $(VENV)/.deps-stamp
PYTEST_ARGS ?=
# pytest-xdist workers for make test and make test-fast (auto: one per core)
TEST_WORKERS ?= auto
COMPILE_CHECK_TORCH ?= 2.12.0

.PHONY: all venv build install test test-fast test-durations test-cpp compile-check test-torch215 test-twin test-axolotl print-python312 test-install mutation-check demo bench gpu-check clean

all: test

# DeepSpeed (requirements/deepspeed.txt) is an sdist whose setup.py imports torch: built against the torch installed
# first, without build isolation, and with no op compiled at install (DS_BUILD_OPS=0).
$(STAMP): requirements/dev.txt requirements/deepspeed.txt $(TORCH_REQ)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r $(TORCH_REQ)
	$(PIP) install -q -r requirements/dev.txt
	$(PIP) install -q "setuptools>=70"
	DS_BUILD_OPS=0 $(PIP) install -q --no-build-isolation -r requirements/deepspeed.txt
	bash tests/install_extra_transformers.sh $(PY)
	touch $(STAMP)

venv: $(STAMP)

# Build and install the package (CMake through scikit-build-core) into .venv. The build folder is kept (build/pkg:
# an edit rebuilds what changed) at the same depth as the test builds (build/cpp-tests, build/emu-*), so that ccache
# (CMakeLists.txt) finds their common compilations, in this checkout and in any other clone.
install: $(STAMP)
	$(PIP) install -q --no-build-isolation --no-deps -C build-dir=build/pkg .

build: install

# Every test, on one pytest-xdist worker per core (about 5 minutes on 2 cores once built; docs/benchmarks.md, "Test
# suite"). The compile check against another torch release's headers is a build check, not a test: .ci/run runs it.
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# The edit-run loop (about 1 minute on 2 cores once built): every test but those marked slow (`@pytest.mark.slow` on
# the test or its module: process launches, documented commands, real-width traces; tests/tools/test_slow_marks.py
# checks the marks against tests/durations.json), then the emulated device's stream rules. `make test` runs everything.
test-fast: install
	$(PY) -m pytest -q -m "not slow" -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)
	HSOFFLOAD_EMU_CHILD=1 $(PY) -m pytest -q -p no:cacheprovider tests/device/emu/test_stream_rules.py

# Refresh tests/durations.json (what tests/tools/test_slow_marks.py judges the slow marks by): the whole suite as
# `make test` runs it, each test's seconds recorded; on an otherwise idle machine (tests/support/durations.py).
test-durations: install
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup --record-durations $(PYTEST_ARGS)

# The library must build against every torch from 2.11 to 2.15 (CPU and CUDA wheels): compile against the headers
# of the releases no leg builds (2.12; the legs build 2.11, 2.13, 2.14.1 and 2.15.0). Any list: COMPILE_CHECK_TORCH="2.11.0 2.12.0".
compile-check: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash scripts/compile_check.sh $(PY) $(COMPILE_CHECK_TORCH)

# The documented install paths, as written, in fresh environments with only torch (README, docs/axolotl.md).
# The main venv's bin goes last on PATH: nothing of it shadows the fresh environments, but CMake finds its ccache.
test-install:
	PATH="$$PATH:$(abspath $(VENV))/bin" bash scripts/install_check.sh $(PYTHON)

# Proof that the emulated-device tests (tests/device/emu) catch every missing stream/event rule: deletes each rule's
# line in a scratch copy of csrc/, rebuilds, reruns tests/device/emu (30-90 s a mutation on 2 cores; not part of CI).
mutation-check: install
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) scripts/mutation_check.py

# C++ engine unit tests (ctest); also run by tests/engine/test_cpp_engine.py.
test-cpp: $(STAMP)
	cmake -S . -B build/cpp -G Ninja -DHSOFFLOAD_BUILD_TESTS=ON -DHSOFFLOAD_PYTHON=$(abspath $(PY))
	cmake --build build/cpp
	ctest --test-dir build/cpp --output-on-failure

# Python 3.12 for the legs that need it (the GPU twin: the GPU image's Python; Axolotl >= 0.20 requires it): python3.12
# on PATH, else a pyenv 3.12. `make -s print-python312` shows which (.ci/run keys the legs' venvs on it).
PYTHON312 ?= $(shell python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null || \
	PYENV_VERSION=$$(pyenv versions --bare 2>/dev/null | grep -m1 '^3\.12') python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null)
print-python312:
	@echo $(PYTHON312)

# Which legs earn their minutes (CI's budget: 40 minutes on 2 cores). The library must build against every torch from
# 2.11 to 2.15: the twin builds 2.11, compile-check 2.12, `make test` 2.13, the Axolotl leg 2.14.1 and this leg 2.15.0.
# The suite runs under 2.13 (everything), 2.15 (this leg: the newest, where torch moves what we rely on), 2.11 (the
# twin: the GPU machine's torch) and 2.14.1 (the Axolotl leg, for Axolotl's paths); the former 2.14 suite leg would
# repeat what those four bracket, so 2.14 is a build and the Axolotl leg's runtime.
# The torch 2.15 leg: the suites that touch torch mechanics (saved-tensor hooks, SAC, compile, DTensor, FSDP2, the
# patch, the emulated device) against the torch 2.15.0 wheel (a CUDA build, run on the CPU), in a venv of its own.
# pip's global constraints file on these machines caps torch at 2.14.1: lifted for this install alone.
VENV215 ?= .venv-torch215
$(VENV215)/.deps-stamp: requirements/torch215.txt requirements/dev.txt
	test -x $(VENV215)/bin/python || $(PYTHON) -m venv $(VENV215)
	PIP_CONSTRAINT=/dev/null $(VENV215)/bin/python -m pip install -q -r requirements/torch215.txt
	touch $@

test-torch215: $(VENV215)/.deps-stamp
	$(VENV215)/bin/python -m pip install -q --no-build-isolation --no-deps -C build-dir=build/torch215 .
	PATH="$(abspath $(VENV215))/bin:$$PATH" $(VENV215)/bin/python -m pytest -q -rs -n $(TEST_WORKERS) --dist loadgroup \
		tests/engine/test_core.py tests/engine/test_tensor_kinds.py \
		tests/engine/test_torchscript_compile.py tests/engine/test_loader.py tests/offload/test_policies.py \
		tests/offload/test_policies_compile.py tests/engine/test_capture.py tests/engine/test_reserve.py \
		tests/engine/test_spill.py tests/offload/test_transformers_models.py tests/offload/test_patch.py \
		tests/offload/test_layer_hooks.py tests/loading/test_fsdp.py tests/integrations/test_axolotl.py \
		tests/offload/test_dtensor.py tests/device/test_emu_device.py

# The twin of the GPU machine: its Python 3.12, torch 2.11.0 (the PyPI CUDA 13.0 wheel, run on the CPU without a
# driver), transformers 5.17.0, accelerate and peft, no trl and no axolotl (requirements/twin.txt), in a venv of its
# own. The whole suite (what needs trl/axolotl skips with its reason), then `make gpu-check`'s script as the GPU
# machine runs it (no network: scripts/twin_gpu_check.sh), every step of its summary required to end ok.
# .ci/run calls it after test-torch215. The suite here is the fast loop (every module; `make test` runs the slow
# tests under torch 2.13) and the emulated device's whole suite, the GPU path's stand-in, under the GPU's torch.
VENVTWIN ?= .venv-twin
TWIN_PYTEST_ARGS ?=
$(VENVTWIN)/.deps-stamp: requirements/twin.txt
	@test -n "$(PYTHON312)" || { echo "test-twin: no python3.12 found; pass PYTHON312=/path/to/python3.12" >&2; exit 1; }
	test -x $(VENVTWIN)/bin/python || $(PYTHON312) -m venv $(VENVTWIN)
	$(VENVTWIN)/bin/python -m pip install -q -r requirements/twin.txt
	touch $@

test-twin: $(VENVTWIN)/.deps-stamp
	PATH="$(abspath $(VENVTWIN))/bin:$$PATH" $(VENVTWIN)/bin/python -m pip install -q --no-build-isolation --no-deps \
		-C build-dir=build/twin .
	PATH="$(abspath $(VENVTWIN))/bin:$$PATH" $(VENVTWIN)/bin/python -m pytest -q -rs -p no:cacheprovider \
		-n $(TEST_WORKERS) --dist loadgroup -m "not slow" $(TWIN_PYTEST_ARGS)
	PATH="$(abspath $(VENVTWIN))/bin:$$PATH" $(VENVTWIN)/bin/python -m pytest -q -rs -p no:cacheprovider \
		-n $(TEST_WORKERS) tests/device/test_emu_device.py
	PATH="$(abspath $(VENVTWIN))/bin:$$PATH" bash scripts/twin_gpu_check.sh $(abspath $(VENVTWIN))/bin/python

# The Axolotl leg of CI: the newest Axolotl that resolves (>= 0.21: Python 3.12, torch 2.14.1; requirements/axolotl.txt)
# in a venv of its own, hsoffload built into it; Axolotl's own tests of its hidden-state offload module against
# hsoffload.axolotl, the differential suite, and `axolotl train` on every CPU config (tests/integrations/axolotl_ci), under
# Axolotl's transformers pin (5.20.1 with 0.21.0). .ci/run calls it last.
VENVAX ?= .venv-axolotl
$(VENVAX)/.deps-stamp: requirements/axolotl.txt
	@test -n "$(PYTHON312)" || { echo "test-axolotl: no python3.12 found; pass PYTHON312=/path/to/python3.12" >&2; exit 1; }
	test -x $(VENVAX)/bin/python || $(PYTHON312) -m venv $(VENVAX)
	$(VENVAX)/bin/python -m pip install -q -r requirements/axolotl.txt
	touch $@

test-axolotl: $(VENVAX)/.deps-stamp
	PATH="$(abspath $(VENVAX))/bin:$$PATH" $(VENVAX)/bin/python -m pip install -q --no-build-isolation --no-deps \
		-C build-dir=build/axolotl .
	PATH="$(abspath $(VENVAX))/bin:$$PATH" $(VENVAX)/bin/python -m pytest -q -rs -p no:cacheprovider \
		-n $(TEST_WORKERS) --dist loadgroup tests/integrations/axolotl_ci

demo: install
	$(VENV)/bin/hsoffload demo

bench: install
	$(VENV)/bin/hsoffload bench

# On a GPU machine (no network; torch, nvcc, cmake, ninja present): build, run GPU tests and the GPU suite.
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf build _skbuild *.egg-info
