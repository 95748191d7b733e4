#!/usr/bin/env bash
# `make peers`: prepares the systems `make bench` compares llmq against (issue 17).
#
# llama.cpp's llama-server is built from the llama.cpp sources that the llama-cpp-python sdist
# vendors, so the peer runs the same kernels as LLMQ_BACKEND=llama_cpp. The flags are the
# portable ones the llama_cpp backend uses (see the Makefile): native flags have crashed with
# "Illegal instruction" on CPUs that report AMX. The binary is static and cached under
# ~/.cache/llmq/peers/, so a second run is instant; the bench finds it at $PEERS/bin/llama-server.
#
# vLLM is checked, not installed (`make vllm` adds it): an absent peer is skipped by the bench.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${LLAMA_CPP_VERSION:-0.3.36}"
PY="${PY:-.venv/bin/python}"
PEERS="${LLMQ_PEERS_DIR:-$HOME/.cache/llmq/peers}"
DEST="$PEERS/llama.cpp-$VERSION"
SERVER="$DEST/bin/llama-server"

build_llama_server() {
  local work="$PEERS/build-$VERSION"
  rm -rf "$work" && mkdir -p "$work"
  echo "peers: fetching the llama-cpp-python $VERSION sdist (it vendors llama.cpp)"
  "$PY" -m pip download -q --no-binary :all: --no-deps -d "$work" "llama-cpp-python==$VERSION"
  tar -xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
  local src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
  local flags=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF)
  if [ "$(uname -m)" = x86_64 ]; then
    flags+=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
  fi
  echo "peers: building llama-server (~7 min on 2 cores)"
  cmake -S "$src" -B "$work/build" -G Ninja "${flags[@]}" >"$work/cmake.log"
  cmake --build "$work/build" --target llama-server -j "$(nproc)"
  mkdir -p "$DEST/bin"
  # Copied under a temporary name and renamed: an interrupted build leaves no half binary.
  cp "$work/build/bin/llama-server" "$SERVER.tmp" && mv "$SERVER.tmp" "$SERVER"
  rm -rf "$work"
}

if [ -x "$SERVER" ]; then
  echo "peers: llama-server $VERSION is built ($SERVER)"
else
  build_llama_server
fi
mkdir -p "$PEERS/bin"
ln -sfn "$SERVER" "$PEERS/bin/llama-server"
"$PEERS/bin/llama-server" --version 2>&1 | grep -m1 -i version || true

if version=$("$PY" -c "import vllm; print(vllm.__version__)" 2>/dev/null); then
  echo "peers: vLLM $version is importable"
else
  echo "peers: vLLM is not installed; the bench reports its peer as skipped (\`make vllm\` adds it)"
fi
