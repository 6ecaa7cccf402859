#!/usr/bin/env bash
# A rehearsal, on a CPU machine, of the GPU check on an offline GPU node: the node's image (Python 3.12, torch 2.11,
# transformers 5.17, pandas, pyarrow, matplotlib, scipy; no vLLM, no megatron-core), the wheelhouse
# (scripts/wheelhouse.sh) as the only source of packages, and no network. scripts/gpu_check.sh runs as it would there:
# it installs the wheelhouse onto the image's torch, the CUDA parts skip (no GPU here), the parts that need vLLM skip
# (the image has none), the rest runs, and the JSON lists each skip with its reason.
#
#     scripts/rehearse_offline_node.sh          # results in $OUT (default ./rehearsal)/gpu_check.json and .log
#     WHEELHOUSE=/path/to/wheelhouse scripts/rehearse_offline_node.sh    # a wheelhouse built before (cp312)
#     REHEARSAL_SHM_MB=0 scripts/rehearse_offline_node.sh                # the host's /dev/shm
#
# Steps: (1) the image, once, into $REHEARSAL_IMAGE (a Python 3.12 venv, from the package index; cached); (2) the
# wheelhouse for cp312 (cached in ./wheelhouse); (3) the check in a fresh copy of the checkout (git archive HEAD plus
# the wheelhouse: what travels) on the machine a lent node may be: namespaces of its own (`unshare -rmnu`) with no
# interface but loopback, a /dev/shm of REHEARSAL_SHM_MB MiB (64, a container's default), a host name in no hosts
# file and a DNS server that never answers (a resolv.conf naming UNROUTED_DNS, routed to loopback inside the
# namespace: a lookup waits out its timeout, and nothing leaves). Where those namespaces are refused: the network cut
# off alone (`unshare -rn`), else pip forced offline (PIP_NO_INDEX=1, proxies to nowhere). Exit code: the check's.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/rehearsal}
IMAGE=${REHEARSAL_IMAGE:-$HOME/.cache/moe-rl-study/offline-node-py3.12}
PY312=${PY312:-}
if [[ -z $PY312 ]]; then
    ver=$(pyenv versions --bare 2>/dev/null | grep '^3\.12\.[0-9]*$' | tail -1 || true)
    if [[ -n $ver ]]; then PY312=$(pyenv prefix "$ver")/bin/python; else PY312=$(command -v python3.12 || true); fi
fi
log() { echo "rehearsal: $*" >&2; }
T0=$(date +%s)

# (1) the image: the packages the CUDA image holds that the harness uses, at its versions (torch 2.11's Linux wheel
# is its CUDA build: it imports on a CPU machine, with its nvidia-* libraries beside it, and sees no GPU)
IMAGE_PINS=("torch==2.11.0" "transformers==5.17.0" "tokenizers" "numpy" "pandas" "pyarrow" "matplotlib" "scipy" "pyyaml"
            "jinja2" "tqdm" "requests" "rich" "tabulate" "psutil" "packaging")
if [[ ! -f $IMAGE/.complete ]]; then
    [[ -n $PY312 ]] || { log "no python3.12 here (PY312=/path/to/python3.12)"; exit 2; }
    log "building the image in $IMAGE (once; from the package index)"
    rm -rf "$IMAGE"
    "$PY312" -m venv "$IMAGE"
    "$IMAGE/bin/python" -m pip install -q "${IMAGE_PINS[@]}"
    touch "$IMAGE/.complete"
fi
"$IMAGE/bin/python" -c "import torch, transformers, sys; print('image: Python', sys.version.split()[0], 'torch',
torch.__version__, 'transformers', transformers.__version__)"

# (2) the wheelhouse for the image's Python (cached); the image given what the wheelhouse counts on it for (the
# CUDA image's own packages: six, protobuf, ...; already there: nothing is fetched)
WH=${WHEELHOUSE:-$ROOT/wheelhouse}
[[ -f $WH/image-provides.txt ]] || WHEELHOUSE=$WH PYTHON=$IMAGE/bin/python scripts/wheelhouse.sh
grep -vE '^(nvidia-|cuda-|jax-|torch$|triton$|transformers$)' "$WH/image-provides.txt" >"$IMAGE/provides.txt"
"$IMAGE/bin/python" -m pip install -q -r "$IMAGE/provides.txt"

# (3) what travels: the committed checkout and the wheelhouse; then the check with the network off
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
git archive HEAD | tar -x -C "$WORK"
cp -r "$WH" "$WORK/wheelhouse"
log "travels: checkout $(git archive HEAD | wc -c) bytes + wheelhouse $(du -sb "$WH" | cut -f1) bytes"
unset WHEELHOUSE  # the check reads the copy beside its checkout
mkdir -p "$OUT"
# STUDY_NATIVE=0: the hf engine's torch decode path, the one a GPU takes (the CPU's C path aside)
export OUT GPU_PYTHON=$IMAGE/bin/python STUDY_NATIVE=0 PIP_NO_INDEX=1 PIP_FIND_LINKS= PIP_CONFIG_FILE=/dev/null \
    HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 http_proxy=http://127.0.0.1:9 \
    https_proxy=http://127.0.0.1:9 HF_HUB_OFFLINE=1
SHM_MB=${REHEARSAL_SHM_MB:-64}
UNROUTED_DNS=10.255.255.1
printf 'nameserver %s\n' "$UNROUTED_DNS" >"$WORK.resolv.conf"
trap 'rm -rf "$WORK" "$WORK.resolv.conf"' EXIT
MACHINE="ip link set lo up && hostname rehearsal-$RANDOM$RANDOM && mount --bind $WORK.resolv.conf /etc/resolv.conf"
MACHINE+=" && ip route add $UNROUTED_DNS/32 dev lo"
(( SHM_MB > 0 )) && MACHINE+=" && mount -t tmpfs -o size=${SHM_MB}m tmpfs /dev/shm"
if unshare -rmnu bash -c "$MACHINE" 2>/dev/null; then
    NET="unshare -rmnu"
    log "machine: only loopback, /dev/shm ${SHM_MB} MiB (0: the host's), a host name in no hosts file, a DNS" \
        "server that does not answer ($UNROUTED_DNS)"
elif unshare -rn true 2>/dev/null; then
    NET="unshare -rn" MACHINE="ip link set lo up"
    log "machine: unshare -rmnu refused here; the network off alone (unshare -rn: only loopback)"
else
    NET="" MACHINE=true
    log "machine: unshare -rn refused here; pip forced offline instead (PIP_NO_INDEX=1, proxies to nowhere)"
fi
set +e
$NET bash -c "$MACHINE"' && cd "$0" && df -m /dev/shm | tail -1 >&2 && scripts/gpu_check.sh' "$WORK"
RC=$?
set -e
log "rc $RC; $(( $(date +%s) - T0 )) s in all; results in $OUT/gpu_check.json, the parts' output in $OUT/gpu_check.log"
exit $RC
