#!/usr/bin/env bash
# The GPU check: one prepared pass, at most 8 minutes on one H100 from cold, over what a GPU run needs, on a small
# Qwen3-MoE shape (4 layers, 32 experts top-8). Parts, each in a process of its own with a time budget (seconds on
# an H100, 455 in all; study/tools/gpu_check.py says what each measures): preflight 20, install 10, megatron 40,
# sharded 40 (distributed optimizer, distributed checkpoint, streamed sync), qwen_layer 45, vllm_parity 80,
# weight_sync 15, r3_routes 15, rl 190 (GRPO + R3 through vLLM, or the hf engine without it; checkpoint and resume,
# sync parity, bf16 master weights). One verdict line per part, then a JSON summary; results in
# $OUT/gpu_check.json ($OUT unset: the checkout), the parts' output in gpu_check.log beside it. One machine: the parts'
# process groups bind loopback (GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo where the environment names no interface);
# /dev/shm is asked for only where a part starts the vLLM engine; a host name that does not resolve is a warning.
#
#     scripts/gpu_check.sh                   # OUT=/some/dir scripts/gpu_check.sh
#     scripts/gpu_check.sh --parts preflight,sharded --budget sharded=60
#     scripts/gpu_check.sh --install-only    # the environment alone (its own step, before a timed check)
#
# The environment: the GPU machine's own torch (a CUDA image's, offline) with the wheelhouse installed beside it.
# Python: $GPU_PYTHON if set; else the project's .venv when its torch sees CUDA; else the image's python3. When that
# Python cannot import the harness's dependencies (megatron-core, reasoning-gym, ...), the wheelhouse
# ($WHEELHOUSE, default ./wheelhouse, built by scripts/wheelhouse.sh where a package index is reachable) is installed
# into .venv-gpu/site (pip --no-index --target, on PYTHONPATH: the image's torch, transformers and the rest stay
# what they are); nothing is fetched from a network. vLLM is not in the wheelhouse: where it is absent the engine
# parts skip with the reason and the rl part runs the hf engine. A Python that still cannot import what the parts
# need stops the check with one line naming the module, before any part runs (exit 2). The time limit
# (GPU_CHECK_LIMIT_S, 480 s) counts from the script's start, the install included (its seconds: the JSON's `note`).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
OUT_FILE=${OUT:-$ROOT}/gpu_check.json
mkdir -p "$(dirname "$OUT_FILE")"
LIMIT_S=${GPU_CHECK_LIMIT_S:-480}  # the check, from this script's start: the wheelhouse's install included
START=$(date +%s)
WHEELHOUSE=${WHEELHOUSE:-$ROOT/wheelhouse}
SITE=$ROOT/.venv-gpu/site
INSTALL_ONLY=0
if [[ ${1:-} == --install-only ]]; then INSTALL_ONLY=1; shift; fi
log() { echo "gpu-check: $*" >&2; }
sees_cuda() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    log "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
    if [[ -n ${GPU_PYTHON:-} ]]; then
        PY=$GPU_PYTHON
    elif [[ -x .venv/bin/python ]] && sees_cuda .venv/bin/python; then
        PY=.venv/bin/python
    else
        PY=python3
    fi
    sees_cuda "$PY" || log "$PY: its torch does not see the GPU (a CPU build, or no torch): the CUDA parts will skip"
else
    log "no NVIDIA GPU here (nvidia-smi missing or finds none): the CUDA parts will be skipped, the rest run on CPU"
    PY=${GPU_PYTHON:-.venv/bin/python}
    [[ -x $PY ]] || command -v "$PY" >/dev/null || PY=python3
fi

# the wheelhouse onto this Python's torch, when the Python lacks the harness's dependencies
NEEDS="import megatron.core, reasoning_gym, tensorboardX, submitit"
NOTE=""
USE_SITE=0
if ! "$PY" -c "$NEEDS" 2>/dev/null; then
    USE_SITE=1
    if [[ -d $SITE ]] && PYTHONPATH=$SITE "$PY" -c "$NEEDS" 2>/dev/null; then
        NOTE="the wheelhouse was installed in .venv-gpu/site before"
    elif [[ -n $(ls "$WHEELHOUSE"/*.whl 2>/dev/null) ]]; then
        T0=$(date +%s)
        rm -rf "$SITE"
        # --no-deps: the wheelhouse is the closure of what the image lacks; --target alone would reinstall the rest
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELHOUSE"/*.whl >&2; then
            NOTE="installed the wheelhouse ($(ls "$WHEELHOUSE"/*.whl | wc -l) wheels) in $(( $(date +%s) - T0 )) s"
        else
            NOTE="pip install of the wheelhouse failed (see above)"
        fi
        log "$NOTE"
    else
        NOTE="no wheelhouse at $WHEELHOUSE"
    fi
fi
(( USE_SITE )) && export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} GPU_CHECK_NOTE=$NOTE
# one line, before any part, when this Python cannot import what the parts need (gpu_check.py's REQUIRES)
"$PY" -m study.tools.gpu_check --environment "$@" || exit 2
if (( INSTALL_ONLY )); then
    "$PY" -c "import torch, megatron.core; print('environment:', torch.__version__, torch.version.cuda)" || exit 2
    exit 0
fi
LEFT=$(( LIMIT_S - ($(date +%s) - START) ))
timeout --signal=TERM --kill-after=15 "$LEFT" "$PY" -m study.tools.gpu_check --out "$OUT_FILE" "$@"
RC=$?
(( RC == 124 )) && log "stopped at the ${LIMIT_S}-s limit; the parts finished so far are in $OUT_FILE"
exit $RC
