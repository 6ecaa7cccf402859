#!/usr/bin/env bash
# The GPU check: one prepared pass, at most 8 minutes on one H100 from cold, over what a GPU run needs, on a small
# Qwen3-MoE shape (4 layers, 32 experts top-8). Parts, each in a process of its own with a time budget (seconds on
# an H100, 455 in all; study/tools/gpu_check.py says what each measures): preflight 20, install 10, megatron 40,
# sharded 40 (distributed optimizer, distributed checkpoint, streamed sync), qwen_layer 45, vllm_parity 80,
# weight_sync 15, r3_routes 15, rl 190 (GRPO + R3 through vLLM, checkpoint and resume, sync parity, bf16 master
# weights). One verdict line per part, then a JSON summary; results in $OUT/gpu_check.json ($OUT unset: the
# checkout), the parts' output in gpu_check.log beside it.
#
#     scripts/gpu_check.sh                   # OUT=/some/dir scripts/gpu_check.sh
#     scripts/gpu_check.sh --parts preflight,sharded --budget sharded=60
#     scripts/gpu_check.sh --install-only    # the environment alone (its own step, before a timed check)
#
# The environment is installed first, as a step of its own, with the pinned wheels (nothing is downloaded once the
# check runs); the time limit (GPU_CHECK_LIMIT_S, 480 s) counts from the end of the install.
#
# Python: $GPU_PYTHON if set; else the project's .venv when its torch sees CUDA; else .venv-gpu, created on first use
# with the CUDA wheels of torch and vLLM (the `cuda` extra's vllm==0.32.0, which pins its CUDA torch; pip, from the
# package registry only: the GPU machines here reach nothing else; the project's .venv holds CPU builds of torch and
# vLLM, which cannot use the GPU). Without a GPU every CUDA part is recorded `skip` with the reason and the rest run on
# the CPU in fp32, so the script is checked anywhere.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
OUT_FILE=${OUT:-$ROOT}/gpu_check.json
mkdir -p "$(dirname "$OUT_FILE")"
LIMIT_S=${GPU_CHECK_LIMIT_S:-480}  # the check, from the end of the install
INSTALL_ONLY=0
if [[ ${1:-} == --install-only ]]; then INSTALL_ONLY=1; shift; fi
log() { echo "gpu-check: $*" >&2; }

NOTE=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    log "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
    if [[ -n ${GPU_PYTHON:-} ]]; then
        PY=$GPU_PYTHON
    elif .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        PY=.venv/bin/python
    else
        PY=.venv-gpu/bin/python
        if ! "$PY" -c "import torch, vllm, megatron.core, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
            2>/dev/null; then
            log "installing the CUDA wheels into .venv-gpu (pip, package registry only)"
            T0=$(date +%s)
            python3 -m venv .venv-gpu || { log "python3 -m venv failed"; exit 2; }
            # vLLM's CUDA wheel pins its own CUDA torch; megatron-core and the harness's other dependencies beside it
            # (the harness itself runs from this checkout through PYTHONPATH).
            .venv-gpu/bin/pip install -q "vllm==0.32.0" "megatron-core==0.16.1" "transformers>=5.16.1,<5.20" \
                "tokenizers>=0.22" "reasoning-gym==0.1.25" "pandas>=2.2" "pyarrow>=15" "matplotlib>=3.8" \
                "scipy>=1.12" "tqdm>=4.66" "submitit>=1.5" "pyyaml>=6" "optuna==5.0.0" jinja2 >&2 \
                || NOTE="pip install into .venv-gpu failed (see the log); "
            NOTE="${NOTE}installed .venv-gpu in $(( $(date +%s) - T0 )) s"
            log "$NOTE"
        fi
    fi
else
    log "no NVIDIA GPU here (nvidia-smi missing or finds none): the CUDA parts will be skipped, the rest run on CPU"
    PY=${GPU_PYTHON:-.venv/bin/python}
    [[ -x $PY ]] || PY=python3
fi

if (( INSTALL_ONLY )); then
    "$PY" -c "import torch, megatron.core; print('environment:', torch.__version__, torch.version.cuda)" || exit 2
    exit 0
fi
START=$(date +%s)
LEFT=$(( LIMIT_S - ($(date +%s) - START) ))
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} GPU_CHECK_NOTE=$NOTE
timeout --signal=TERM --kill-after=15 "$LEFT" "$PY" -m study.tools.gpu_check --out "$OUT_FILE" "$@"
RC=$?
(( RC == 124 )) && log "stopped at the ${LIMIT_S}-s limit; the parts finished so far are in $OUT_FILE"
exit $RC
