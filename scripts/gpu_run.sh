#!/usr/bin/env bash
# Runs the GPU bundle (scripts/gpu_bundle.sh) on a GPU node: unpacks
# .gpu/muster-gpu.tar.xz to /tmp/muster, prints the GPUs and the driver, then
# runs the named steps, each bounded by `timeout`, each logged to
# $OUT/<step>.log (and to stdout), and ends with a summary table.
#
# Usage (from the repository root): scripts/gpu_run.sh [STEP...]
# Steps (default: link kernels model bench):
#   selfcheck  ldd and RPATH of every bundled binary; needs no GPU
#   link       bin/cuda_link_check
#   kernels    bin/fast_cuda_test $KERNELS_ARGS        (Catch2)
#   model      bin/model_cuda_test $MODEL_ARGS         (Catch2)
#   sanitizer  compute-sanitizer --tool memcheck bin/fast_cuda_test $SANITIZER_ARGS
#   bench      bin/bench_gpu $BENCH_ARGS
#   torch      python3 bin/bench_gpu_torch.py $TORCH_ARGS (the node's own
#              environment: none of the bundle's libraries)
#   train      bin/worker on each of $TRAIN_CONFIGS (default
#              examples/tiny_cuda.yaml: examples/tiny.yaml with device: cuda)
# Environment:
#   OUT           where logs go (default /tmp/gpu_out)
#   STEP_TIMEOUT  seconds per step (default 300)
#   GPU_TARBALL   the bundle (default .gpu/muster-gpu.tar.xz)
#   MUSTER_HOME   where it is unpacked (default /tmp/muster; replaced)
# Exit status: 0 when every step passed, 1 when one failed, 2 on a usage or
# set-up error.
#
# The bundle's libraries reach only the bundle's binaries, through
# LD_LIBRARY_PATH set per command (the bundle's lib/, the node's cuBLAS and
# NCCL folders, then the node's own LD_LIBRARY_PATH): nothing is exported, so
# the node's Python and PyTorch never see them.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

ALL_STEPS=(selfcheck link kernels model sanitizer bench torch train)
DEFAULT_STEPS=(link kernels model bench)

OUT=${OUT:-/tmp/gpu_out}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
GPU_TARBALL=${GPU_TARBALL:-.gpu/muster-gpu.tar.xz}
MUSTER_HOME=${MUSTER_HOME:-/tmp/muster}
TRAIN_CONFIGS=${TRAIN_CONFIGS:-examples/tiny_cuda.yaml}

die() {
  echo "gpu_run: ERROR: $*" >&2
  exit 2
}

# --- arguments ---------------------------------------------------------------
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=("${DEFAULT_STEPS[@]}")
for step in "${steps[@]}"; do
  known=0
  for s in "${ALL_STEPS[@]}"; do [ "$step" = "$s" ] && known=1; done
  [ $known -eq 1 ] || die "unknown step '$step' (steps: ${ALL_STEPS[*]})"
done
if ! [[ "$STEP_TIMEOUT" =~ ^[1-9][0-9]*$ ]]; then
  die "STEP_TIMEOUT must be a positive number of seconds"
fi
command -v timeout >/dev/null || die "no 'timeout' command"

# --- unpack ------------------------------------------------------------------
[ -f "$GPU_TARBALL" ] || die "no bundle at $GPU_TARBALL: run scripts/gpu_bundle.sh first"
mkdir -p "$OUT" || die "cannot create OUT=$OUT"
case "$MUSTER_HOME" in
  /tmp/* | /var/tmp/*) ;;
  *) [ ! -e "$MUSTER_HOME" ] || [ -f "$MUSTER_HOME/BUNDLE.txt" ] ||
       die "MUSTER_HOME=$MUSTER_HOME exists and is not a bundle; not replacing it" ;;
esac
rm -rf "$MUSTER_HOME" || die "cannot remove $MUSTER_HOME"
mkdir -p "$MUSTER_HOME" || die "cannot create $MUSTER_HOME"
timeout 120 tar -xJf "$GPU_TARBALL" -C "$MUSTER_HOME" --strip-components=1 ||
  die "cannot unpack $GPU_TARBALL"
echo "gpu_run: unpacked $GPU_TARBALL ($(stat -c %s "$GPU_TARBALL") bytes) to $MUSTER_HOME"
grep -E '^(source|built|newest)' "$MUSTER_HOME/BUNDLE.txt" 2>/dev/null | sed 's/^/  /'

# --- library path for the bundle's binaries ---------------------------------
# The bundle's lib/ (also the binaries' RPATH), then wherever this node keeps
# cuBLAS 13 and NCCL 2.
lib_dirs=("$MUSTER_HOME/lib")
add_dir() {
  local d=$1 e
  [ -d "$d" ] || return 0
  d=$(cd "$d" && pwd -P)
  for e in "${lib_dirs[@]}"; do [ "$e" = "$d" ] && return 0; done
  lib_dirs+=("$d")
}
for d in /usr/local/cuda/lib64 /usr/local/cuda-13*/targets/x86_64-linux/lib \
         /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
  add_dir "$d"
done
find_lib() {
  local name=$1 d
  for d in "${lib_dirs[@]}"; do [ -e "$d/$name" ] && { echo "$d/$name"; return 0; }; done
  d=$(/sbin/ldconfig -p 2>/dev/null | awk -v n="$name" '$1 == n { print $NF; exit }')
  [ -n "$d" ] && { echo "$d"; return 0; }
  # Last resort: a pip-installed copy (nvidia-cublas-cu13, nvidia-nccl-cu13).
  d=$(timeout 30 find /usr/local/lib /usr/lib /opt -xdev -name "$name" -print -quit 2>/dev/null)
  [ -n "$d" ] && { echo "$d"; return 0; }
  return 1
}
for name in libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
  if path=$(find_lib "$name"); then
    add_dir "$(dirname "$path")"
    echo "gpu_run: $name: $path"
  else
    echo "gpu_run: WARNING: $name not found on this node; GPU binaries will not start" >&2
  fi
done
BUNDLE_LD_PATH=$(IFS=:; echo "${lib_dirs[*]}")
# Keep what the node already sets (its driver's folder, say), after ours.
if [ -n "${LD_LIBRARY_PATH:-}" ]; then
  BUNDLE_LD_PATH="$BUNDLE_LD_PATH:$LD_LIBRARY_PATH"
fi
echo "gpu_run: LD_LIBRARY_PATH for bundled binaries: $BUNDLE_LD_PATH"

# --- the GPU -----------------------------------------------------------------
if command -v nvidia-smi >/dev/null; then
  timeout 30 nvidia-smi -L
  echo "driver: $(timeout 30 nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
  timeout 30 nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv,noheader 2>/dev/null
else
  echo "gpu_run: no nvidia-smi on PATH (no GPU here?)"
fi

# --- running ----------------------------------------------------------------
# bundled CMD...: a bundled binary, with the bundle's library path.
bundled() {
  env LD_LIBRARY_PATH="$BUNDLE_LD_PATH" "$@"
}

# run_worker ARGS...: bin/worker from $MUSTER_HOME, so examples/*.yaml find
# data/tiny/ and write to out/ there. The hook for training runs.
run_worker() {
  (cd "$MUSTER_HOME" && bundled bin/worker "$@")
}

# words VAR: the words of $VAR, split on blanks but not globbed (Catch2
# filters such as [cuda] are glob patterns), one per line for mapfile.
words() {
  local -a w
  read -r -a w <<< "${!1:-}"
  [ ${#w[@]} -eq 0 ] || printf '%s\n' "${w[@]}"
}

need() {
  [ -e "$MUSTER_HOME/$1" ] || { echo "gpu_run: $1 is not in the bundle" >&2; return 127; }
}

find_sanitizer() {
  local c
  c=$(command -v compute-sanitizer 2>/dev/null) && { echo "$c"; return 0; }
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-13*/bin/compute-sanitizer \
           /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    [ -x "$c" ] && { echo "$c"; return 0; }
  done
  return 1
}

step_selfcheck() {
  local status=0 f out
  for f in "$MUSTER_HOME"/bin/*; do
    head -c 4 "$f" 2>/dev/null | grep -q 'ELF' || continue
    echo "--- $(basename "$f"): $(readelf -d "$f" 2>/dev/null |
      sed -n 's/.*(\(RPATH\|RUNPATH\)).*\[\(.*\)\]/\1 \2/p')"
    out=$(bundled ldd "$f" 2>&1)
    echo "$out" | grep -v "$MUSTER_HOME/bin/../lib/"
    echo "  ($(echo "$out" | grep -c "$MUSTER_HOME/bin/../lib/") libraries from the bundle)"
    if echo "$out" | grep -q 'not found'; then
      echo "  FAIL: unresolved libraries or symbol versions above"
      status=1
    fi
  done
  return $status
}

step_link() { need bin/cuda_link_check && bundled bin/cuda_link_check; }

step_kernels() {
  local -a args
  mapfile -t args < <(words KERNELS_ARGS)
  need bin/fast_cuda_test && bundled bin/fast_cuda_test "${args[@]}"
}

step_model() {
  local -a args
  mapfile -t args < <(words MODEL_ARGS)
  need bin/model_cuda_test && bundled bin/model_cuda_test "${args[@]}"
}

step_sanitizer() {
  local sanitizer
  local -a args
  mapfile -t args < <(words SANITIZER_ARGS)
  need bin/fast_cuda_test || return 127
  sanitizer=$(find_sanitizer) || { echo "gpu_run: compute-sanitizer not found" >&2; return 127; }
  bundled "$sanitizer" --tool memcheck --error-exitcode 1 bin/fast_cuda_test "${args[@]}"
}

step_bench() {
  local -a args
  mapfile -t args < <(words BENCH_ARGS)
  need bin/bench_gpu && bundled bin/bench_gpu "${args[@]}"
}

step_torch() {
  local -a args
  mapfile -t args < <(words TORCH_ARGS)
  need bin/bench_gpu_torch.py && python3 bin/bench_gpu_torch.py "${args[@]}"
}

step_train() {
  local cfg status=0 metrics
  need bin/worker || return 127
  # examples/tiny.yaml says device: auto, which falls back to the CPU; the
  # GPU run must fail instead.
  sed 's/^device:.*/device: cuda/' examples/tiny.yaml > examples/tiny_cuda.yaml || return 1
  rm -rf out
  local -a configs
  mapfile -t configs < <(words TRAIN_CONFIGS)
  for cfg in "${configs[@]}"; do
    echo "--- bin/worker $cfg"
    run_worker "$cfg" || status=1
  done
  for metrics in out/*/metrics.jsonl; do
    [ -f "$metrics" ] || continue
    echo "--- $metrics (last 3 of $(wc -l < "$metrics") lines)"
    tail -3 "$metrics"
  done
  return $status
}

names=()
results=()
seconds=()
for step in "${steps[@]}"; do
  log="$OUT/$step.log"
  echo
  echo "===== $step (timeout ${STEP_TIMEOUT}s, log $log)"
  start=$(date +%s.%N)
  # The step runs in a child bash so `timeout` can bound it, group and all.
  (
    cd "$MUSTER_HOME" || exit 2
    export -f bundled run_worker words need find_sanitizer "step_$step"
    export BUNDLE_LD_PATH MUSTER_HOME TRAIN_CONFIGS
    timeout -k 10 "$STEP_TIMEOUT" bash -c "step_$step"
  ) 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  end=$(date +%s.%N)
  wall=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
  case $rc in
    0) result=pass ;;
    124 | 137) result="FAIL (timeout)" ;;
    *) result="FAIL (exit $rc)" ;;
  esac
  echo "===== $step: $result in ${wall}s" | tee -a "$log"
  names+=("$step")
  results+=("$result")
  seconds+=("$wall")
done

echo
echo "===== summary ($(hostname), $(date -u +%Y-%m-%dT%H:%M:%SZ))"
printf '%-10s %-16s %9s\n' step result seconds
failed=0
for i in "${!names[@]}"; do
  printf '%-10s %-16s %9s\n' "${names[$i]}" "${results[$i]}" "${seconds[$i]}"
  [ "${results[$i]}" = pass ] || failed=$((failed + 1))
done
echo "$((${#names[@]} - failed)) passed, $failed failed"
[ $failed -eq 0 ]
