#!/usr/bin/env bash
# The GPU check: one prepared pass (at most 8 minutes on one H200) over what a GPU run needs, on a small Qwen3-MoE
# shape (4 layers, 32 experts top-8): the CUDA install, Megatron bf16 forward/backward, vLLM CUDA generation with
# log-prob parity against the trainer, weight sync, R3 routes, one RL step and its time split (study/tools/gpu_check.py
# says what each part measures). Results: one JSON file, $OUT/gpu_check.json ($OUT unset: ./gpu_check.json).
#
#     scripts/gpu_check.sh                   # OUT=/some/dir scripts/gpu_check.sh
#
# Python: $GPU_PYTHON if set; else the project's .venv when its torch sees CUDA; else .venv-gpu, created on first use
# with the CUDA wheels of torch and vLLM (pip, from the package registry only: the GPU machines here reach nothing
# else; the project's .venv holds CPU builds of torch and vLLM, which cannot use the GPU). Without a GPU every
# CUDA part is recorded `skip` with the reason and the rest run on the CPU in fp32, so the script is checked anywhere.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
OUT_FILE=${OUT:-$ROOT}/gpu_check.json
mkdir -p "$(dirname "$OUT_FILE")"
LIMIT_S=${GPU_CHECK_LIMIT_S:-480}  # the whole script, install included
START=$(date +%s)
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

LEFT=$(( LIMIT_S - ($(date +%s) - START) ))
(( LEFT > 30 )) || { log "no time left after the install (${LIMIT_S} s limit)"; exit 1; }
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} GPU_CHECK_NOTE=$NOTE
timeout --signal=TERM --kill-after=15 "$LEFT" "$PY" -m study.tools.gpu_check --out "$OUT_FILE" "$@"
RC=$?
(( RC == 124 )) && log "stopped at the ${LIMIT_S}-s limit; the parts finished so far are in $OUT_FILE"
exit $RC
