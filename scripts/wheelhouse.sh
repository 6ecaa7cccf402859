#!/usr/bin/env bash
# The wheelhouse for a GPU machine without a network: the wheels the harness needs beyond what the CUDA image already
# holds (torch, transformers, numpy, pandas, pyarrow, matplotlib, scipy, ...: IMAGE_HAS), for the image's Python,
# gathered here (a machine with a package index) into ./wheelhouse (git-ignored). The GPU machine installs them with
# `pip install --no-index --find-links wheelhouse` onto its own torch (scripts/gpu_check.sh does; docs/gpu.md).
#
#     scripts/wheelhouse.sh                          # TARGET_PY=3.12 (the CUDA image's), into ./wheelhouse
#     TARGET_PY=3.11 WHEELHOUSE=/tmp/wh scripts/wheelhouse.sh
#     IMAGE_LIST=image-freeze.txt scripts/wheelhouse.sh  # the image's `python3 -m pip freeze`, instead of IMAGE_HAS
#
# The dependencies are resolved by that Python's own pip (PYTHON, default pythonX.Y for TARGET_PY; pyenv's is found),
# so markers and wheels match it; those the image has are left out (a second torch or transformers would replace the
# image's CUDA build); the rest is fetched as wheels, the few pure sdists (cellpylib, zss, pycosat) built into wheels
# here. vLLM is not in it: its CUDA wheel is 327 MB and pins its own torch (the engine parts skip without it).
# Prints the wheelhouse's size: it travels with the checkout, the two at most 64 MiB together.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET_PY=${TARGET_PY:-3.12}
WHEELHOUSE=${WHEELHOUSE:-$ROOT/wheelhouse}
PY=${PYTHON:-}
if [[ -z $PY ]]; then
    ver=$(pyenv versions --bare 2>/dev/null | grep "^$TARGET_PY\.[0-9]*$" | tail -1 || true)
    if [[ -n $ver ]]; then PY=$(pyenv prefix "$ver")/bin/python; else PY=$(command -v "python$TARGET_PY" || true); fi
fi
[[ -n $PY ]] || { echo "wheelhouse: no python$TARGET_PY here: PYTHON=/path/to/python$TARGET_PY" >&2; exit 2; }
got=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[[ $got == "$TARGET_PY" ]] || { echo "wheelhouse: $PY is Python $got, not TARGET_PY=$TARGET_PY" >&2; exit 2; }
# What the harness needs that the CUDA image lacks (pyproject.toml's pins).
WANT=("megatron-core==0.16.1" "reasoning-gym==0.1.25" "tensorboardX>=2.6" "submitit>=1.5" "optuna==5.0.0")
# The CUDA image's Python packages: never fetched. IMAGE_LIST names a file of the image's own `pip freeze` (or
# `pip list --format=freeze`) output to take them from instead of this list.
IMAGE_HAS=" absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson
ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numpy numpyro nvidia-ml-py onnx onnxruntime opencv-python-headless optax opt-einsum packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pytest python-dateutil pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken tokenizers
toolz torch torchaudio torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3
uvloop werkzeug wheel wrapt xarray xxhash yarl zipp "
if [[ -n ${IMAGE_LIST:-} ]]; then IMAGE_HAS=" $(sed 's/[ =@<>~!;].*//' "$IMAGE_LIST" | tr '\n' ' ') "; fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# 1. resolve WANT and its dependencies for this Python (metadata only: nothing large is downloaded)
"$PY" -m pip install -q --dry-run --ignore-installed --report "$TMP/report.json" "${WANT[@]}"
"$PY" - "$TMP/report.json" "$IMAGE_HAS" "$TMP/pins" "$TMP/provided" <<'PY'
import json, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
have = {norm(n) for n in sys.argv[2].split()}
pins, provided = [], []
for item in json.load(open(sys.argv[1]))["install"]:
    name = norm(item["metadata"]["name"])
    if name in have or name.startswith(("nvidia-", "cuda-", "jax-")):
        provided.append(name)
    else:
        pins.append(f"{name}=={item['metadata']['version']}")
open(sys.argv[3], "w").write("\n".join(pins) + "\n")
open(sys.argv[4], "w").write("\n".join(provided) + "\n")
PY
# 2. fetch them as wheels (a pure sdist built into one), none of their dependencies again
rm -rf "$WHEELHOUSE"
mkdir -p "$WHEELHOUSE"
"$PY" -m pip wheel -q --no-deps -w "$WHEELHOUSE" -r "$TMP/pins"
# the dependencies the wheelhouse counts on the image for (scripts/rehearse_offline_node.sh gives its image these)
cp "$TMP/provided" "$WHEELHOUSE/image-provides.txt"
printf 'wheelhouse: %s wheels for Python %s in %s, %s bytes: %s\n' "$(ls "$WHEELHOUSE"/*.whl | wc -l)" "$TARGET_PY" \
    "$WHEELHOUSE" "$(du -sb "$WHEELHOUSE" | cut -f1)" "$(tr '\n' ' ' <"$TMP/pins")"
