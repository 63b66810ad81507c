# The two commands of the README: `make run` and `make test`. Both set up
# everything they need first (tools/setup.sh), and are quick when nothing changed.
PY      := .venv/bin/python
BUILD   := build
JOBS    ?= $(shell nproc)
PYENV   := PYTHONPATH=$(CURDIR)/python

.PHONY: setup build run bench-quick repeat-distributed test test-cpp test-python test-install test-sanitize fuzz-build fuzz test-fuzz bench clean

setup:
	@bash tools/setup.sh

$(BUILD)/build.ninja: CMakeLists.txt | setup
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSA_BUILD_TESTS=ON \
	  -DDSA_BUILD_BENCH=ON -DDSA_BUILD_PYTHON=ON -DPython_EXECUTABLE=$(CURDIR)/$(PY)

build: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

# Main job: the training comparison (dsa-train --compare) at its default size:
# DeepSeek-V4 unpatched vs on dsa's fused ops. Tables on stdout, build/train.json,
# build/train.png.
run: build
	$(PYENV) $(PY) -m dsa.train --compare

# The quick kernel benchmark (make bench runs every case).
bench-quick: build
	$(PYENV) $(PY) -m dsa.bench --quick

# Full benchmark (all cases; writes build/bench.json and prints the table).
bench: build
	$(PYENV) $(PY) -m dsa.bench --json $(BUILD)/bench.json

test: build test-cpp test-python test-install test-sanitize test-fuzz

test-cpp: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# Two pytest workers (pytest-xdist): most of the suite's time is in single-threaded child
# processes (dsa-train, dsa-bench, gloo ranks at --threads 1) and their imports, which
# left a third of a 2-core machine idle. loadfile: a file's tests run in order in one
# worker, its module fixtures once (test by test, --dist worksteal, took longer);
# tests/python/conftest.py puts the longest files first and --no-loadscope-reorder keeps
# that order (xdist would hand out the files with the most tests first, leaving the long
# ones to the end). OpenMP threads wait passively:
# two workers' torch ops share 2 cores, and spinning at their barriers had made some
# in-process tests 2-9x slower. On an AVX2-only Zen 1 class EPYC (2026-12-07): one process
# 638 s, two workers 458 s, passive waits 420 s. PYTEST_WORKERS=0: one process.
# --durations lists the slowest tests in the log.
PYTEST_WORKERS ?= 2
test-python: build
	OMP_WAIT_POLICY=passive $(PYENV) $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests/python

# The install paths users take: `pip install .` and find_package(dsa).
test-install: setup
	bash tools/test_install.sh

# The C++ suite under AddressSanitizer + UndefinedBehaviorSanitizer. It is built in
# the fuzz build (clang 14, -O1, no UBSan recovery), which serves the fuzz targets
# too: one sanitizer build instead of two, 412 -> 241 s of compiling on a 2-core Zen 1
# class EPYC, for a suite that runs 112-122 s there against the GCC build's 80 s.
# A GCC sanitizer build is -DDSA_SANITIZE=ON (CMakeLists.txt).
test-sanitize: fuzz-build
	cd $(FUZZ_BUILD) && ctest --output-on-failure -j $(JOBS)

# libFuzzer targets of tests/fuzz (clang 14, ASan + UBSan), one per op family, and
# the C++ suite under the same flags.
# `make fuzz` runs each for FUZZ_SECONDS; `make test` runs each for
# FUZZ_CI_SECONDS with a fixed libFuzzer seed, which replays the seed corpus
# (past findings included) and fuzzes a little, the same way on every run. -O1: the kernels stay fast enough under ASan to fuzz.
FUZZ_BUILD      := $(BUILD)-fuzz
FUZZ_SECONDS    ?= 120
FUZZ_CI_SECONDS ?= 10

fuzz-build: setup
	cmake -S . -B $(FUZZ_BUILD) -G Ninja -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only" -DDSA_BUILD_FUZZ=ON -DDSA_BUILD_TESTS=ON
	cmake --build $(FUZZ_BUILD) -j $(JOBS)

fuzz: fuzz-build
	bash tools/run_fuzz.sh $(FUZZ_BUILD) $(FUZZ_SECONDS) $(JOBS)

test-fuzz: fuzz-build
	bash tools/run_fuzz.sh $(FUZZ_BUILD) $(FUZZ_CI_SECONDS) $(JOBS) 1

# The distributed (gloo) suites REPEATS times in a row, each run in a fresh pytest
# bounded by REPEAT_TIMEOUT seconds: what fails, and whether a rank died by a
# signal (docs/hardening.md). Not part of make test (tens of minutes).
REPEATS        ?= 30
REPEAT_TIMEOUT ?= 600
repeat-distributed: build
	$(PY) tools/repeat_distributed.py --runs $(REPEATS) --timeout $(REPEAT_TIMEOUT)

clean:
	rm -rf $(BUILD) $(BUILD)-sanitize $(FUZZ_BUILD)
