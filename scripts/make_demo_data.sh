#!/usr/bin/env bash
# Writes the demo data set: about 2.5 MB of English text (the fortune-cookie
# collections of Debian's `fortunes` package, BSD-licensed) as byte-level
# llm.c token shards, data/tiny/train_000000.bin and data/tiny/val_000000.bin
# (the last 10% of the text), which the globs of examples/tiny*.yaml,
# data/tiny/train_*.bin and data/tiny/val_*.bin, read. See docs/data.md.
#
# Idempotent: installs `fortunes` only if missing; a rerun rewrites the same
# bytes (for the same package version).
# Usage: make_demo_data.sh [OUT_DIR]   (default data/tiny)
# BAZEL (default "bazel") and BAZEL_BUILD_FLAGS choose how //tools:mkdata is built.
set -euo pipefail
cd "$(dirname "$0")/.."

out_dir=${1:-data/tiny}
BAZEL=${BAZEL:-bazel}
read -r -a build_flags <<< "${BAZEL_BUILD_FLAGS:-}"

if ! dpkg-query -W -f='${Status}' fortunes 2>/dev/null | grep -q "install ok installed"; then
  echo "make_demo_data: installing the Debian package 'fortunes' (the demo text)" >&2
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends fortunes >/dev/null
fi

# Every collection the two packages install, in a fixed (byte) order; not
# the strfile indexes (*.dat), the *.u8 symlinks, or the two ASCII-art files,
# which are pictures rather than prose.
mapfile -t texts < <(dpkg -L fortunes fortunes-min | grep '^/usr/share/games/fortunes/' |
  grep -v -e '\.dat$' -e '\.u8$' -e '/art$' -e '/ascii-art$' |
  while read -r path; do [ -f "$path" ] && [ ! -L "$path" ] && echo "$path"; done |
  LC_ALL=C sort)
if [ ${#texts[@]} -eq 0 ]; then
  echo "make_demo_data: no fortune files found under /usr/share/games/fortunes" >&2
  exit 1
fi

$BAZEL build "${build_flags[@]}" //tools:mkdata
bin=$($BAZEL info "${build_flags[@]}" bazel-bin 2>/dev/null)
"$bin/tools/mkdata" --out "$out_dir" --val-fraction 0.1 "${texts[@]}"
