# The two commands of the README, plus helpers. Everything installs into .venv through constraints.txt.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: train test test-fast lint docs bench gpu-check clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -c constraints.txt torch==2.13.0
	$(PIP) install -c constraints.txt -e '.[dev,video,onnx,atari,minatar,mujoco,mpe,mlflow,wandb,tune,envpool,docs]'
	touch $(STAMP)

# PPO on CartPole-v1 with the default config (add overrides with ARGS="env.id=Acrobot-v1 ...").
train: $(STAMP)
	$(BIN)/python -m ppo_fabric $(ARGS)

# Lint, the docs build (strict: a broken link or page fails it; not -q, which hides the warnings strict
# counts), then the whole suite (unit, probe environments, real multi-process runs on CPU) on one worker
# more than the cores (pytest-xdist; the longest tests start first as workers steal them): the multi-process
# tests spend part of their time waiting (rendezvous, a launcher's 5-s look, stall timeouts), which a third
# worker fills on 2 cores (7m09s against 8m53s). ARGS="-n 0" runs it in one process.
WORKERS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 1) + 1 )))
test: $(STAMP)
	$(BIN)/ruff check .
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
	$(BIN)/python -m pytest -n $(WORKERS) --dist worksteal $(ARGS)

# The inner loop: the unit tier only (in-process, quick; no process starts), under 90 s on 2 cores.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m unit -n auto --dist worksteal -q $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The docs site (mkdocs.yml, docs/) into site/; `$(BIN)/mkdocs serve` previews it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

$(VENV)/.bench: $(STAMP)
	$(PIP) install -c constraints.txt -e '.[dev,bench]'
	touch $@

# Throughput and learning benchmarks (~1.2 h on 2 cores); figures land in benchmarks/results/. The set, its
# order and arguments are benchmarks/__main__.py's table (`$(BIN)/python -m benchmarks` lists it); a failing
# benchmark is reported and the rest still run.
bench: $(VENV)/.bench
	$(BIN)/python -m benchmarks all

# Prove the CUDA paths (resume round trip, CPU<->GPU resume, SIGTERM) on a GPU machine; SKIPs without CUDA.
# No venv needed (a lent GPU box may have no network): PY is .venv's python if there is one, else python3;
# override with `make gpu-check PY=python3`, add ARGS="--device cpu" to run the checks on the CPU.
PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	$(PY) benchmarks/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) runs outputs site .pytest_cache .ruff_cache
