#!/usr/bin/env bash
# `make gpu-check ARGS="..."`: bench/gpu_check.py on a machine that has PyTorch and
# transformers but no package registry (the lent GPU machine). llmq's other runtime
# dependencies come from the wheels `make gpu-wheels` fetched into .gpu-wheels/ beforehand,
# installed offline into a folder put on PYTHONPATH: a venv made from the machine's Python
# would not see its packages when that Python is itself a venv's (/opt/torch/.venv there).
# PY: the Python that holds torch (default python3). Without .gpu-wheels/ the check runs on
# PY's own packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
WHEELS=${GPU_WHEELS:-.gpu-wheels}
"$PY" -c "import torch, transformers" || {
  echo "gpu_check: $PY has no torch or transformers" >&2; exit 1; }
if [ -f "$WHEELS/requirements.txt" ]; then
  version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  site=${GPU_CHECK_SITE:-/tmp/llmq-gpu-site-$version}
  # The pins name the whole closure (scripts/gpu_wheels.py): no resolver, no registry.
  # A failed install is reported, not fatal: the check itself needs torch and transformers
  # alone, and a lent machine's minutes are too few to lose to it. GPU_CHECK_STRICT=1 (CI's
  # rehearsal) makes it fatal, and so is then an llmq module the wheels leave unimportable.
  if cmp -s "$WHEELS/requirements.txt" "$site/.installed" || {
      rm -rf "$site" &&
      "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
        --find-links "$WHEELS" --target "$site" -r "$WHEELS/requirements.txt" &&
      cp "$WHEELS/requirements.txt" "$site/.installed"; }; then
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_check: installing $WHEELS/ failed (above): running on $PY's own packages" >&2
    [ -z "${GPU_CHECK_STRICT:-}" ] || exit 1
  fi
  "$PY" -c "import app.wsgi, worker.celery_app, worker.tasks, gunicorn, llguidance, psutil" || {
    echo "gpu_check: llmq's runtime does not import with $WHEELS/" >&2
    [ -z "${GPU_CHECK_STRICT:-}" ] || exit 1; }
else
  echo "gpu_check: no $WHEELS/ (make gpu-wheels): running on $PY's own packages" >&2
fi
export PYTHONUNBUFFERED=1
if [ -z "${GPU_CHECK_TESTS:-}" ]; then
  exec "$PY" -m bench.gpu_check "$@"
fi
# GPU_CHECK_TESTS=1: the model-worker tests on CUDA too (LLMQ_TEST_DEVICE=cuda, the cuda
# cases alone), after the check. Their tiny model takes the default model's tokenizer, which
# .gpu-wheels/tokenizer/ carries; a HOME of their own holds it where ModelManager looks, beside
# an empty weights file that nothing here reads (the real cache stays untouched).
status=0
"$PY" -m bench.gpu_check "$@" || status=$?
home=/tmp/llmq-gpu-home
model="$home/.cache/llmq/models/SmolLM2-135M-Instruct"
mkdir -p "$model" && cp "$WHEELS"/tokenizer/* "$model"/ && touch "$model/model.safetensors"
HOME="$home" LLMQ_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -k cuda \
  tests/worker/test_batch_invariance.py tests/worker/test_kv_cache.py || status=$?
exit $status
