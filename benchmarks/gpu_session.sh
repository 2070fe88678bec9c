#!/usr/bin/env bash
# Everything a short GPU lease should prove, in one command, most important first, each step bounded so that a
# lease cut short still returns what finished (each script rewrites its report after every row or check):
#   1. gpu_check.py        every CUDA path: resume (same device, CPU<->GPU), SIGTERM, compile on/off, EnvPool
#                          Pong, CPU players feeding a GPU trainer;
#   2. minibatch_step.py   the Nature-CNN minibatch step eager / compiled / one CUDA graph;
#   3. gpu_strategies.py   Pong: 1 GPU trainer + K CPU players (K from PLAYERS), the most players again with
#                          the compiled step, then coupled on the GPU with gymnasium's async envs and with
#                          EnvPool (32 envs each), ATARI_STEPS env steps per row.
# Reports go to OUT_DIR (flat: gpu_check.json, minibatch_step.{json,md}, gpu-strategies.{json,md}).
#
#     bash benchmarks/gpu_session.sh OUT_DIR [ATARI_STEPS]        (PY=python3 by default, PLAYERS="4 8 14")
#     bash .whl/remote.sh bash benchmarks/gpu_session.sh "$OUT" 120000    (on a lent machine without network)
set -u
out=${1:?usage: gpu_session.sh OUT_DIR [ATARI_STEPS]}
steps=${2:-120000}
py=${PY:-python3}
players=${PLAYERS:-4 8 14}
most=$(printf '%s\n' $players | sort -n | tail -1)
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 1

step() {  # step SECONDS COMMAND...: run it, at most SECONDS, and say how it ended
    local limit=$1 start=$SECONDS
    shift
    echo "=== $* (limit ${limit} s)"
    timeout -k 10 "$limit" "$@"
    echo "=== rc=$? after $((SECONDS - start)) s: $*"
}

step "${CHECK_S:-240}" "$py" benchmarks/gpu_check.py --out "$out/gpu_check.json"
step "${STEP_S:-150}" "$py" benchmarks/minibatch_step.py --out "$out"
variants=()
for k in $players; do variants+=("decoupled-gpu-$k"); done
variants+=("decoupled-gpu-$most-compile")
# shellcheck disable=SC2086
step "${LAYOUT_S:-360}" "$py" benchmarks/gpu_strategies.py --only atari --players $players \
    --variants "${variants[@]}" --atari-steps "$steps" --out "$out"
step "${ENVPOOL_S:-150}" "$py" benchmarks/gpu_strategies.py --only envpool --envpool-steps "$steps" --out "$out"
