#!/usr/bin/env bash
# Every GPU path of gptopt, run and measured in one call of under nine minutes, the install included.
#
#   bash .ci/gpu_check.sh DIR [--report SMALL]  # on the GPU machine; SMALL: results.json,
#                                               # summary.txt, logs.txt only (DIR also gets checkpoints)
#   bash .ci/gpu_check.sh --dry-run DIR    # anywhere: each step, its command and time limit
#   python3 .ci/gpu_check.py record DIR    # then: DIR/results.json -> rows of docs/gpu-results.md
#
# The machine needs no network: weights are random, the corpus is Python's stdlib, and the first
# step installs gptopt over the machine's own CUDA torch (never reinstalling torch):
#   python3 -m pip install --no-index --no-deps --no-build-isolation -e .
# gptopt's core needs torch, numpy, safetensors, tokenizers, tqdm and psutil; the steps also use
# transformers, nvidia-ml-py, pytest and the serve and quant extras. A package the image lacks
# (results.json's "missing" names them; a bare CUDA image often lacks fastapi, starlette, pydantic,
# pydantic-core, annotated-types, typing-inspection, uvicorn and torchao, fastapi 0.165's
# opentelemetry-api and annotated-doc, and loadtest's aiohttp with its own) travels as wheels fetched
# on a machine with network, for the GPU machine's Python and a torchao built for its torch (0.18 goes
# with torch 2.11; the wheels' own --platform tags may need adding, e.g. manylinux_2_17_x86_64):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     -d .whl fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn torchao==0.18.0 \
#     opentelemetry-api annotated-doc importlib-metadata zipp \
#     aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna \
#     openai httpx2 httpcore2 truststore jiter sniffio   # transformers serve, the serve step's peer
# and the install step installs them with gptopt when GPTOPT_WHEELS names their folder (default: .whl).
#
# Each step runs with its own time limit and the run never stops early: a failing step keeps its
# log (DIR/STEP.log) and error tail, and DIR/results.json and DIR/summary.txt are rewritten after
# every step. Exit status 0 only when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
case "${1:-}" in
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  "") echo "usage: bash .ci/gpu_check.sh DIR [--report SMALL] [--only STEP,...] | --dry-run DIR | --help" >&2; exit 2 ;;
  --dry-run) shift; exec "$py" .ci/gpu_check.py dry-run "$@" ;;
esac
exec "$py" .ci/gpu_check.py run "$@"
