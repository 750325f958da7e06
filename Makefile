# Two commands on a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing (CPU torch first, so nothing pulls a CUDA build),
# re-install only when pyproject.toml changed, build the CPU operators (kernels/csrc/, with the
# system C++ compiler) when their sources changed, then run.

PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
TORCH   ?= torch==2.13.0
PYTEST_ARGS ?=
OPS     := kernels/_ops/pdserve_cpu_ops.so
OPS_SRC := $(wildcard kernels/csrc/*.cpp kernels/csrc/*.h) kernels/build.py

.PHONY: demo test test-slow lint format bench proto clean ops

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip >/dev/null

$(STAMP): pyproject.toml | $(VPY)
	$(VPY) -m pip install "$(TORCH)"
	$(VPY) -m pip install -e '.[dev]'
	@# Hugging Face's `kernels` (left by transformers>=5.25) takes the import name of kernels/
	$(VPY) -m pip uninstall -y -q kernels 2>/dev/null || true
	touch $(STAMP)

# the CPU operators (torch.ops.pdserve.*): kernels/cpu_ops.py warns and runs the PyTorch path without them
$(OPS): $(OPS_SRC) $(STAMP)
	$(VPY) -m kernels.build

ops: $(OPS)

demo: $(STAMP) $(OPS)
	$(VENV)/bin/pdserve demo

# Two pytest-xdist workers (a test file stays on one worker, with its module's cluster), then the
# tests marked `serial` alone: their assertions time the machine (the marker: pyproject.toml).
# TEST_WORKERS=0 runs everything in one process. A part that PYTEST_ARGS leaves empty (pytest's
# exit status 5) is no failure. The 25 slowest tests are listed at the end (the suite's budget: 20 minutes).
TEST_WORKERS ?= 2
test: $(STAMP) $(OPS)
	@rc=0; \
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0 --durations=25 -m "not serial" $(PYTEST_ARGS) \
		|| { r=$$?; [ $$r -eq 5 ] || rc=$$r; }; \
	$(VPY) -m pytest -q -m serial $(PYTEST_ARGS) || { r=$$?; [ $$r -eq 5 ] || rc=$$r; }; \
	exit $$rc

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy  # configured in pyproject.toml [tool.mypy]; strict on the modules listed there

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test-slow: $(STAMP) $(OPS)
	PDSERVE_SLOW=1 $(MAKE) test

proto: $(STAMP)
	$(VPY) proto/generate.py

bench: $(STAMP) $(OPS)
	$(VPY) bench/engine_vs_transformers.py

clean:
	rm -rf $(VENV) build *.egg-info kernels/_ops
