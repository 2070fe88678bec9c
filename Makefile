# The two commands of the README, plus helpers. Everything installs into .venv through constraints.txt.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: train test lint bench gpu-check clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -c constraints.txt torch==2.13.0
	$(PIP) install -c constraints.txt -e '.[dev,video,onnx,atari,mujoco,mpe,mlflow,wandb,tune,envpool]'
	touch $(STAMP)

# PPO on CartPole-v1 with the default config (add overrides with ARGS="env.id=Acrobot-v1 ...").
train: $(STAMP)
	$(BIN)/python -m ppo_fabric $(ARGS)

# Lint, then the whole suite (unit, probe environments, real multi-process runs on CPU).
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

$(VENV)/.bench: $(STAMP)
	$(PIP) install -c constraints.txt -e '.[dev,bench]'
	touch $@

# Throughput and learning benchmarks (~2.5 h on 2 cores); figures land in benchmarks/results/.
bench: $(VENV)/.bench
	$(BIN)/python benchmarks/profile_split.py
	$(BIN)/python benchmarks/numpy_rollout.py
	$(BIN)/python benchmarks/pipelined_vs_sb3.py --rounds 5
	$(BIN)/python benchmarks/cartpole_vs_sb3.py
	$(BIN)/python benchmarks/cartpole_vs_sb3.py --sb3-threads 0 --name cartpole_vs_sb3_default_threads
	$(BIN)/python benchmarks/decoupled_vs_coupled.py
	$(BIN)/python benchmarks/scaling.py
	$(BIN)/python benchmarks/fast_recipe.py
	$(BIN)/python benchmarks/tensordict_overhead.py
	$(BIN)/python benchmarks/cartpole_solve.py
	$(BIN)/python benchmarks/lunarlander.py
	$(BIN)/python benchmarks/policy_lag.py
	$(BIN)/python benchmarks/lunarlander.py --env pendulum --seeds 2
	$(BIN)/python benchmarks/cartpole_lstm.py --seeds 2
	$(BIN)/python benchmarks/multiagent.py

# Prove the CUDA paths (resume round trip, CPU<->GPU resume, SIGTERM) on a GPU machine; SKIPs without CUDA.
# No venv needed (a lent GPU box may have no network): PY is .venv's python if there is one, else python3;
# override with `make gpu-check PY=python3`, add ARGS="--device cpu" to run the checks on the CPU.
PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	$(PY) benchmarks/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) runs outputs .pytest_cache .ruff_cache
