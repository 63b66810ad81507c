# The two commands of the README: `make run` and `make test`. Both set up
# everything they need first (tools/setup.sh), and are quick when nothing changed.
PY      := .venv/bin/python
BUILD   := build
JOBS    ?= $(shell nproc)
PYENV   := PYTHONPATH=$(CURDIR)/python

.PHONY: setup build run bench-quick test test-cpp test-python test-install test-sanitize bench clean

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

test: build test-cpp test-python test-install test-sanitize

test-cpp: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

test-python: build
	$(PYENV) $(PY) -m pytest -q tests/python

# The install paths users take: `pip install .` and find_package(dsa).
test-install: setup
	bash tools/test_install.sh

test-sanitize: setup
	cmake -S . -B $(BUILD)-sanitize -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDSA_BUILD_TESTS=ON -DDSA_SANITIZE=ON
	cmake --build $(BUILD)-sanitize -j $(JOBS)
	cd $(BUILD)-sanitize && ctest --output-on-failure -j $(JOBS)

clean:
	rm -rf $(BUILD) $(BUILD)-sanitize
