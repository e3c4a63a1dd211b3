#!/usr/bin/env bash
# Installs, when missing, the Debian packages muster builds and tests against.
# Idempotent: a second run installs nothing and exits 0.
# Usage: setup.sh [--test]
set -euo pipefail

PACKAGES=(
  bazel-bootstrap
  g++
  libgrpc++-dev
  protobuf-compiler-grpc
  libprotobuf-dev
  libabsl-dev
  libspdlog-dev
  libcli11-dev
  catch2
  libyaml-cpp-dev
  zlib1g-dev
  libgloo-dev
  libopenblas-dev
  libssl-dev
  openssl
  libcpp-httplib-dev
)

# Tests also run unmodified PyTorch scripts under `launch`, and compare with
# torchrun, so `setup.sh --test` adds Debian's PyTorch (/usr/bin/python3).
if [ "${1:-}" = "--test" ]; then
  PACKAGES+=(python3-torch)
fi

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "setup: installing ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
