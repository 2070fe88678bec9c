#!/usr/bin/env bash
# Everything a short GPU lease should prove, in one command, each part bounded so that a lease cut short still
# returns what finished (each script rewrites its report after every row or check). The parts, in PARTS order
# (default "check step layouts envpool"):
#   check     gpu_check.py: every CUDA path (resume on one device and CPU<->GPU, SIGTERM, compile on/off,
#             EnvPool Pong, CPU players feeding a GPU trainer); CHECKS names some of them (default all);
#   step      minibatch_step.py: the Nature-CNN minibatch step eager / algo.compile=graph, then compiled alone,
#             then the bare CUDA graph alone,
#             then the whole step under tensordict's CudaGraphModule alone, and compiled inside it alone;
#   graph     the CUDA-graph step alone, and if it fails, again with CUDA_LAUNCH_BLOCKING=1 (the failing kernel's
#             own stack instead of the next synchronisation's);
#   layouts   gpu_strategies.py on Pong: the decoupled layouts of LAYOUTS (default: 1 GPU trainer + K CPU
#             players for K in PLAYERS, the most players with the players acting on the GPU, and 2 EnvPool
#             players acting on the GPU), ATARI_STEPS env steps per row;
#   envpool   gpu_strategies.py: coupled Pong on the GPU with EnvPool (32 envs), the layouts' baseline; add
#             gymnasium's async envs with ENVPOOL_VARIANTS="gymnasium-async envpool";
#   score     atari_to_score.py: Pong to a return of 18 at the best layout (3 EnvPool players + 1 GPU trainer),
#             the lr annealed over SCORE_STEPS env steps (10M, CleanRL's), the run stopped after SCORE_RUN_S
#             seconds (500); by default without sticky actions, as the published marks run, and with the
#             whole-step graph (SCORE_EXTRA, label SCORE_LABEL: "no-sticky-graph"); SCORE_EXTRA= SCORE_LABEL=
#             runs exp=atari's own (ALE v5's sticky actions, eager); evaluated during training (--eval). The
#             run is kept in runs/pong_<label> (git-ignored, so it stays while the machine is warm): the
#             `score` part called again continues it from its checkpoint (resume=auto) toward SCORE_STEPS;
#   startup   where one process's start-up goes (import torch, first CUDA op, import lightning, import the
#             strategies), printed: a job's start-up is what each of its processes pays; then the same in
#             STARTUP_COPIES (15) processes at once, as a 14-player job starts them.
# Each Pong run is stopped after RUN_S seconds (default 120) and reports its last logged update, so a row
# exists for every run started even where the machine starts processes slowly; each part's limit is CHECK_S,
# STEP_S, LAYOUT_S, ENVPOOL_S. Reports go to OUT_DIR (flat: gpu_check.json, minibatch_step.{json,md},
# gpu-strategies.{json,md}).
#
#     bash benchmarks/gpu_session.sh OUT_DIR [ATARI_STEPS]        (PY=python3 by default, PLAYERS="4 8 14")
#     bash .whl/remote.sh bash benchmarks/gpu_session.sh "$OUT" 500000    (on a lent machine without network)
set -u
out=${1:?usage: gpu_session.sh OUT_DIR [ATARI_STEPS]}
steps=${2:-500000}
py=${PY:-python3}
players=${PLAYERS:-4 8 14}
most=$(printf '%s\n' $players | sort -n | tail -1)
layouts=${LAYOUTS:-decoupled-envpool-2 $(for k in $(printf '%s\n' $players | sort -rn); do
    printf 'decoupled-gpu-%s ' "$k"; [ "$k" = "$most" ] && printf 'decoupled-gpuplay-%s ' "$k"; done)}
run_s=${RUN_S:-120}
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 1

startup_probe='import time
t = time.perf_counter()
def lap(what):
    global t
    now = time.perf_counter()
    print(f"startup: {what} {now - t:.1f} s", flush=True)
    t = now
import torch; lap("import torch")
torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu").sum().item(); lap("first CUDA op")
import lightning_fabric; lap("import lightning_fabric")
import ppo_fabric.ppo, ppo_fabric.ppo_decoupled; lap("import the strategies")'

step() {  # step SECONDS COMMAND...: run it, at most SECONDS, say how it ended and return its status
    local limit=$1 start=$SECONDS rc
    shift
    echo "=== $* (limit ${limit} s)"
    timeout -k 10 "$limit" "$@"
    rc=$?
    echo "=== rc=$rc after $((SECONDS - start)) s: $*"
    return $rc
}

for part in ${PARTS:-check step layouts envpool}; do
    case $part in
    check)
        # shellcheck disable=SC2086
        step "${CHECK_S:-360}" "$py" benchmarks/gpu_check.py --out "$out/gpu_check.json" ${CHECKS:+--only $CHECKS}
        ;;
    step)  # the CUDA-graph variant in a process of its own, away from the compiled variant's CUDA graphs
        step "${STEP_S:-150}" "$py" benchmarks/minibatch_step.py --variants eager compile-graph --out "$out"
        step "${STEP_S:-150}" "$py" benchmarks/minibatch_step.py --variants compiled --out "$out"
        step 60 "$py" benchmarks/minibatch_step.py --variants graph --out "$out"
        ;;
    graph)
        step 60 "$py" benchmarks/minibatch_step.py --variants graph --out "$out" ||
            CUDA_LAUNCH_BLOCKING=1 step 60 "$py" benchmarks/minibatch_step.py --variants graph --out "$out"
        ;;
    layouts)
        # shellcheck disable=SC2086
        step "${LAYOUT_S:-600}" "$py" benchmarks/gpu_strategies.py --only atari --players $players \
            --envpool-players 2 --variants $layouts --atari-steps "$steps" --run-timeout "$run_s" --out "$out"
        ;;
    envpool)
        # shellcheck disable=SC2086
        step "${ENVPOOL_S:-150}" "$py" benchmarks/gpu_strategies.py --only envpool --envpool-steps "$steps" \
            --envpool-variants ${ENVPOOL_VARIANTS:-envpool} --run-timeout "$run_s" --out "$out"
        ;;
    score)
        # the published marks' dynamics unless told otherwise (SCORE_LABEL= SCORE_EXTRA= for exp=atari's own)
        label=${SCORE_LABEL-no-sticky-graph}
        # shellcheck disable=SC2086
        step $((${SCORE_RUN_S:-500} + 40)) "$py" benchmarks/atari_to_score.py --eval --steps "${SCORE_STEPS:-10000000}" \
            --run-timeout "${SCORE_RUN_S:-500}" --label "$label" --out "$out" --run-dir "runs/pong${label:+_$label}" \
            --keep-metrics "$out/atari_to_score${label:+_$label}.metrics.csv" \
            -- ${SCORE_EXTRA-+env.kwargs.repeat_action_probability=0 algo.compile=graph}
        ;;
    startup)
        step 60 "$py" - <<<"$startup_probe"
        # the same in as many processes at once as a 14-player job starts: contention shows as longer laps
        # shellcheck disable=SC2016
        step 120 bash -c '(for _ in $(seq "$1"); do "$2" - <<<"$3" & done; wait) | sort | uniq -c' _ \
            "${STARTUP_COPIES:-15}" "$py" "$startup_probe"
        ;;
    *) echo "unknown part $part (startup, check, step, graph, layouts, envpool, score)" >&2; exit 2 ;;
    esac
done
