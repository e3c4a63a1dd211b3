#!/usr/bin/env bash
# Runs the GPU bundle (scripts/gpu_bundle.sh) on a GPU node: unpacks
# .gpu/muster-gpu.tar.xz to /tmp/muster, prints the GPUs and the driver, then
# runs the named steps, each bounded by `timeout`, each logged to
# $OUT/<step>.log (and to stdout), and ends with a summary table.
#
# Usage (from the repository root): scripts/gpu_run.sh [STEP...]
# Steps (default: link kernels model bench):
#   selfcheck  ldd and RPATH of every bundled binary (bin/baseline's too);
#              needs no GPU
#   link       bin/cuda_link_check
#   kernels    bin/fast_cuda_test $KERNELS_ARGS        (Catch2)
#   cudnn      bin/fast_cuda_test --warn NoTests '[cudnn]' $CUDNN_ARGS: cuDNN
#              attention (kernels/fast/cudnn_attention.h) against the CPU, and bit
#              for bit; fails at once if no libcudnn.so.9 was found
#   model      bin/model_cuda_test $MODEL_ARGS         (Catch2)
#   staged     bin/staged_group_cuda_test $STAGED_ARGS (Catch2): Gloo on
#              device buffers through pinned host memory, 2 and 3 ranks as
#              threads sharing GPU 0 over 127.0.0.1
#   sanitizer  compute-sanitizer --tool memcheck bin/fast_cuda_test $SANITIZER_ARGS
#   bench      bin/bench_gpu $BENCH_ARGS
#   flash      bin/bench_flash $FLASH_ARGS: the flash-attention kernels alone
#              per tiling, and cuDNN's through muster, against PyTorch's
#              scaled_dot_product_attention (its choice, and its flash,
#              cuDNN and efficient kernels each alone)
#   gemm       bin/bench_gemm $GEMM_ARGS: GPT-2 124M's GEMMs, the engine's
#              cuBLASLt algorithm against the others the heuristic offers
#   ab         the bundle's benches against its baseline's (a bundle built with
#              BASELINE=<commit>: bin/baseline), on this GPU: each tool of
#              $AB_TOOLS (default "bench_flash bench_gpu") run $AB_RUNS times
#              (3) per build, alternating (the baseline first in odd rounds,
#              the new build first in even ones), then scripts/ab_compare.py:
#              each timed row's median per build and new / baseline.
#              $AB_FLASH_ARGS (default --no-torch --rounds 3) and $AB_GPU_ARGS
#              (default --precisions bf16,tf32 --attention muster,cudnn
#              --cuda-graph on --no-torch: every choice named, since the
#              tool's defaults changed on 2026-11-27) are passed to both
#              builds
#   fsdpcpu    bin/bench_fsdp --skip-rss $FSDP_ARGS: FSDP against DDP and the
#              communication hidden, on the node's CPU cores (no GPU): the
#              same measurement as on a 2-core machine, without two ranks and
#              their communication threads sharing 2 cores
#   profile    ncu (Nsight Compute) over one step of bin/bench_gpu
#              $PROFILE_ARGS (default --precisions bf16, so the worker's
#              default attention; no CUDA graphs),
#              every kernel's time, then scripts/profile_summary.py: the
#              $PROFILE_TOP (40) kernels by time, with launches and means
#              ($OUT/profile.csv keeps ncu's rows; the model's set-up
#              kernels are in it too, once each)
#   torch      python3 bin/bench_gpu_torch.py $TORCH_ARGS (the node's own
#              environment: none of the bundle's libraries)
#   train      bin/worker on each of $TRAIN_CONFIGS (default
#              examples/tiny_cuda.yaml: examples/tiny.yaml with device: cuda)
#   curve      examples/tiny.yaml in fp32 and in bf16, $CURVE_STEPS steps: every
#              logged loss after step $CURVE_AFTER within $CURVE_REL (relative)
#   determinism  the same bf16 run twice, $DETERMINISM_STEPS steps: every
#              step's loss bit-identical
#   resume     a bf16 run killed (SIGKILL) once its step-40 checkpoint is
#              committed, then resumed: every later loss bit-identical to an
#              uninterrupted run's ($RESUME_STEPS steps, $RESUME_MODEL)
#   ddp1       a world of one over NCCL (WORLD_SIZE=1, parallel.backend: nccl);
#              rank 0 logs NCCL's transports
#              against one process alone: every loss bit-identical
#   ddp2       launch --standalone --nproc_per_node=2 with parallel.backend:
#              gloo (both ranks on this GPU, staged through pinned memory),
#              B=4 each, against 1 process at B=8: every loss within 1e-5
#              (relative) over 20 steps
#   ddpnccl2   2 ranks with backend nccl: with one GPU NCCL refuses them;
#              the job must fail fast (within 60 s) with an error naming NCCL,
#              not hang. With 2 or more GPUs it must train instead.
#   ddpkill    ddp2's job with checkpoints: rank 1 SIGKILLed after step 10's
#              checkpoint; rank 0 must be gone within 2 s, launch restarts the
#              job, it finishes, and its losses after the restart equal an
#              uninterrupted run's bit for bit. (Under launch the agent stops
#              rank 0 the moment rank 1 dies, so this does not show rank 0
#              leaving its collective by itself: on the CPU that is
#              //tests/worker/strategy:ddp_watchdog_test and ddp_launch_test.)
#   fsdp1      FSDP with a world of one over NCCL, ZeRO-1, 2 and 3 in bf16,
#              gathering in fp32: against one process alone, every loss
#              within 1e-5 (relative) over 30 steps (not bit for bit: the
#              clipping norm sums the shard's buffers, not the engine's one
#              padded allocation); gathering in bf16: within 2e-2 of it
#              (every weight rounded) and within 1e-5 of each other; every
#              memory line says "equal"
#   fsdp2      launch --standalone --nproc_per_node=2 with parallel.backend:
#              gloo (both ranks on this GPU, staged through pinned memory),
#              ZeRO-2 and ZeRO-3, B=4 each, against 1 process at B=8: every
#              loss within 1e-5 (relative) over 20 steps; and ZeRO-3 with
#              bf16 gathers against a world of one gathering in bf16
#              (within 1e-4: rounding to bf16 is a step function)
#   hsdp       launch --standalone --nproc_per_node=4, parallel.backend:
#              gloo, HSDP 2 replicas x 2 shards at ZeRO-3 (sub-groups
#              staged through pinned memory), B=2 each, against 1 process
#              at B=8: every loss within 1e-5 over 20 steps
#   fsdpspeed  GPT-2 124M (T=1024, B=8, bf16), a world of one over NCCL:
#              DDP, FSDP ZeRO-2, ZeRO-3 and ZeRO-3 with bf16 gathers, each
#              twice, in alternating order, $FSDPSPEED_STEPS steps; the
#              median step time after step 10 and each one's ratio to DDP's
#              (a world of one's collectives are copies: FSDP's overhead)
#   ddpbench   bin/bench_ddp --device cuda $DDPBENCH_ARGS: GPT-2 124M (bf16,
#              T=1024, B=8 per rank): 1 rank without DDP against 2 ranks
#              sharing this GPU over Gloo staged through pinned memory
#              (under launch), and in one process DDP with a world of one
#              over NCCL and over staged Gloo against no DDP: the step time
#              DDP adds, the buckets reduced alone, the part hidden
#              (GPU_RUN_DEVICE=cpu: the small GPT on the CPU over Gloo)
#   (GPU_RUN_DEVICE=cpu: ddp1, ddp2, ddpkill, fsdp1, fsdp2, hsdp and fsdpspeed
#   (examples/tiny.yaml's model) run on the CPU over Gloo as a dry run of the
#   script; ddpnccl2 is skipped)
#   (curve, determinism and resume compare metrics files with
#   scripts/compare_metrics.py from this checkout, so they need python3)
# Environment:
#   OUT           where logs go (default /tmp/gpu_out)
#   CUDNN_DIR     the folder of libcudnn.so.9 (default: found, see below)
#   STEP_TIMEOUT  seconds per step (default 300)
#   GPU_TARBALL   the bundle (default .gpu/muster-gpu.tar.xz)
#   MUSTER_HOME   where it is unpacked (default /tmp/muster; replaced)
#   GPU_RUN_DEVICE  cuda (default) or cpu: a dry run on the CPU (fp32
#                 wherever a step would use bf16) of curve, determinism,
#                 resume and the DDP and FSDP steps listed above
#   CURVE_STEPS (300), CURVE_AFTER (50), CURVE_REL (0.01), DETERMINISM_STEPS
#   (60), RESUME_STEPS (80), RESUME_MODEL (key=value overrides of the
#   resume run's model and data; default on cuda "model.layers=8
#   model.dim=256 model.heads=4 model.seq_len=256 data.micro_batch=16",
#   on cpu none: tiny.yaml's model)
#   DDPBENCH_ARGS (none): more bench_ddp flags for ddpbench (--micro-batch,
#   --rounds, --steps, --world-of-one ...)
# Exit status: 0 when every step passed, 1 when one failed, 2 on a usage or
# set-up error.
#
# The bundle's libraries reach only the bundle's binaries, through
# LD_LIBRARY_PATH set per command (the bundle's lib/, the node's cuBLAS and
# NCCL folders, cuDNN's folder, then the node's own LD_LIBRARY_PATH): nothing
# is exported, so the node's Python and PyTorch never see them.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

ALL_STEPS=(selfcheck link kernels cudnn model staged sanitizer bench flash gemm ab profile fsdpcpu torch train curve
           determinism resume ddp1 ddp2 ddpnccl2 ddpkill ddpbench fsdp1 fsdp2 hsdp fsdpspeed)
DEFAULT_STEPS=(link kernels model bench)

OUT=${OUT:-/tmp/gpu_out}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
GPU_TARBALL=${GPU_TARBALL:-.gpu/muster-gpu.tar.xz}
MUSTER_HOME=${MUSTER_HOME:-/tmp/muster}
TRAIN_CONFIGS=${TRAIN_CONFIGS:-examples/tiny_cuda.yaml}
# This checkout: the steps run in $MUSTER_HOME and find the comparison
# script here.
REPO=$(pwd -P)
COMPARE_METRICS="$REPO/scripts/compare_metrics.py"
AB_COMPARE="$REPO/scripts/ab_compare.py"
AB_DIR="$OUT/ab"
AB_TOOLS=${AB_TOOLS:-bench_flash bench_gpu}
AB_RUNS=${AB_RUNS:-3}
AB_FLASH_ARGS=${AB_FLASH_ARGS:---no-torch --rounds 3}
AB_GPU_ARGS=${AB_GPU_ARGS:---precisions bf16,tf32 --attention muster,cudnn --cuda-graph on --no-torch}
GPU_RUN_DEVICE=${GPU_RUN_DEVICE:-cuda}
CURVE_STEPS=${CURVE_STEPS:-300}
CURVE_AFTER=${CURVE_AFTER:-50}
CURVE_REL=${CURVE_REL:-0.01}
DETERMINISM_STEPS=${DETERMINISM_STEPS:-60}
RESUME_STEPS=${RESUME_STEPS:-80}
FSDPSPEED_STEPS=${FSDPSPEED_STEPS:-60}
DDPBENCH_ARGS=${DDPBENCH_ARGS:-}
PROFILE_ARGS=${PROFILE_ARGS:---precisions bf16}
PROFILE_TOP=${PROFILE_TOP:-40}
PROFILE_CSV="$OUT/profile.csv"
PROFILE_SUMMARY="$REPO/scripts/profile_summary.py"
if [ "$GPU_RUN_DEVICE" = cuda ]; then
  RESUME_MODEL=${RESUME_MODEL-model.layers=8 model.dim=256 model.heads=4 model.seq_len=256 data.micro_batch=16}
else
  RESUME_MODEL=${RESUME_MODEL-}
fi

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
case "$GPU_RUN_DEVICE" in
  cuda | cpu) ;;
  *) die "GPU_RUN_DEVICE must be cuda or cpu, not '$GPU_RUN_DEVICE'" ;;
esac
for var in CURVE_STEPS CURVE_AFTER DETERMINISM_STEPS RESUME_STEPS; do
  [[ "${!var}" =~ ^[0-9]+$ ]] || die "$var must be a number of steps"
done
if [ "$CURVE_STEPS" -eq 0 ] || [ "$DETERMINISM_STEPS" -eq 0 ]; then
  die "CURVE_STEPS and DETERMINISM_STEPS must be > 0"
fi
[ "$RESUME_STEPS" -gt 40 ] || die "RESUME_STEPS must be > 40 (the run is killed after step 40)"
[[ "$CURVE_REL" =~ ^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$ ]] || die "CURVE_REL must be a number"

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

# cuDNN 9, which the binaries load with dlopen (libcudnn.so.9, and the
# engine libraries it loads from its own folder) only when attention runs
# through cuDNN, so ldd does not name it and the bundle does not carry it.
# On the lent machine it is in PyTorch's environment (pip's nvidia-cudnn
# wheel), not in the CUDA toolkit. Looked for, in order: $CUDNN_DIR; the
# folders above and ldconfig's; the nvidia.cudnn package of the python3 on
# PATH, then of /opt/torch/.venv's python3 (a namespace package in some
# wheels, with no __file__: its __path__ is asked, without importing torch);
# the documented folder; a search under /opt and /usr/local. Its folder goes
# on the bundled binaries' LD_LIBRARY_PATH, after cuBLAS's and NCCL's.
CUDNN_PY='
import importlib.util, os, sys
def locations(name):
    try:
        spec = importlib.util.find_spec(name)
    except Exception:
        return []
    return list(spec.submodule_search_locations or []) if spec else []
found = [os.path.join(d, "lib") for d in locations("nvidia.cudnn")]
found += [os.path.join(d, sub, "lib") for d in locations("nvidia") for sub in sorted(os.listdir(d))
          if os.path.isdir(os.path.join(d, sub, "lib"))]
found += [os.path.join(d, "lib") for d in locations("torch")]
for lib in found:
    if os.path.exists(os.path.join(lib, "libcudnn.so.9")):
        print(os.path.realpath(lib))
        sys.exit(0)
sys.exit(1)
'
find_cudnn() {
  local d py
  if [ -n "${CUDNN_DIR:-}" ]; then
    [ -e "$CUDNN_DIR/libcudnn.so.9" ] && { echo "$CUDNN_DIR/libcudnn.so.9 (CUDNN_DIR)"; return 0; }
    echo "gpu_run: WARNING: CUDNN_DIR=$CUDNN_DIR has no libcudnn.so.9; looking elsewhere" >&2
  fi
  for d in "${lib_dirs[@]}"; do
    [ -e "$d/libcudnn.so.9" ] && { echo "$d/libcudnn.so.9 (the library folders above)"; return 0; }
  done
  d=$(/sbin/ldconfig -p 2>/dev/null | awk '$1 == "libcudnn.so.9" { print $NF; exit }')
  [ -n "$d" ] && { echo "$d (ldconfig)"; return 0; }
  for py in "$(command -v python3 2>/dev/null)" /opt/torch/.venv/bin/python3; do
    [ -n "$py" ] && [ -x "$py" ] || continue
    d=$(timeout 30 "$py" -c "$CUDNN_PY" 2>/dev/null) &&
      { echo "$d/libcudnn.so.9 ($py's nvidia.cudnn)"; return 0; }
  done
  for d in /opt/torch/.venv/lib/python3*/site-packages/nvidia/cudnn/lib; do
    [ -e "$d/libcudnn.so.9" ] && { echo "$d/libcudnn.so.9 (PyTorch's environment)"; return 0; }
  done
  d=$(timeout 30 find /opt /usr/local -xdev -name libcudnn.so.9 -print -quit 2>/dev/null)
  [ -n "$d" ] && { echo "$d (found under /opt or /usr/local)"; return 0; }
  return 1
}
CUDNN_LIB=""
if cudnn_found=$(find_cudnn); then
  CUDNN_LIB=${cudnn_found%% (*}
  add_dir "$(dirname "$CUDNN_LIB")"
  echo "gpu_run: libcudnn.so.9: $cudnn_found; cuDNN folder $(cd "$(dirname "$CUDNN_LIB")" && pwd -P)"
else
  echo "gpu_run: WARNING: libcudnn.so.9 not found on this node (set CUDNN_DIR);" \
    "cuDNN attention (the cudnn step, bench_flash's cudnn rows) will fail" >&2
fi

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

# find_cuda_tool NAME PATH...: NAME from PATH, else the first executable
# of the PATHs (CUDA's tools are not always on PATH).
find_cuda_tool() {
  local c
  c=$(command -v "$1" 2>/dev/null) && { echo "$c"; return 0; }
  shift
  for c in "$@"; do
    [ -x "$c" ] && { echo "$c"; return 0; }
  done
  return 1
}

find_sanitizer() {
  find_cuda_tool compute-sanitizer /usr/local/cuda/bin/compute-sanitizer \
    /usr/local/cuda-13*/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer
}

find_ncu() {
  find_cuda_tool ncu /usr/local/cuda/bin/ncu /usr/local/cuda-13*/bin/ncu \
    /opt/nvidia/nsight-compute/*/ncu
}

step_selfcheck() {
  local status=0 f out
  # bin/baseline: a baseline's benches (gpu_bundle.sh BASELINE=...), whose
  # RPATH is $ORIGIN/../../lib.
  local from_bundle="$MUSTER_HOME/bin/\(baseline/\.\./\)\?\.\./lib/"
  for f in "$MUSTER_HOME"/bin/* "$MUSTER_HOME"/bin/baseline/*; do
    [ -f "$f" ] && head -c 4 "$f" 2>/dev/null | grep -q 'ELF' || continue
    echo "--- ${f#"$MUSTER_HOME"/bin/}: $(readelf -d "$f" 2>/dev/null |
      sed -n 's/.*(\(RPATH\|RUNPATH\)).*\[\(.*\)\]/\1 \2/p')"
    out=$(bundled ldd "$f" 2>&1)
    echo "$out" | grep -v "$from_bundle"
    echo "  ($(echo "$out" | grep -c "$from_bundle") libraries from the bundle)"
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

step_cudnn() {
  local -a args
  mapfile -t args < <(words CUDNN_ARGS)
  need bin/fast_cuda_test || return 127
  [ -n "$CUDNN_LIB" ] || { echo "gpu_run: no libcudnn.so.9 on this node (set CUDNN_DIR)" >&2; return 1; }
  echo "cuDNN: $CUDNN_LIB"
  bundled bin/fast_cuda_test --warn NoTests '[cudnn]' "${args[@]}"
}

step_model() {
  local -a args
  mapfile -t args < <(words MODEL_ARGS)
  need bin/model_cuda_test && bundled bin/model_cuda_test "${args[@]}"
}

step_staged() {
  local -a args
  mapfile -t args < <(words STAGED_ARGS)
  need bin/staged_group_cuda_test && bundled bin/staged_group_cuda_test "${args[@]}"
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

step_flash() {
  local -a args
  mapfile -t args < <(words FLASH_ARGS)
  need bin/bench_flash || return 127
  echo "cuDNN: ${CUDNN_LIB:-not found (no cudnn rows)}"
  bundled bin/bench_flash "${args[@]}"
}

step_gemm() {
  local -a args
  mapfile -t args < <(words GEMM_ARGS)
  need bin/bench_gemm || return 127
  bundled bin/bench_gemm "${args[@]}"
}

# Nsight Compute's time of every kernel of one bench_gpu step (no CUDA
# graphs, so each launch is its own), summed by kernel; see `profile` above.
step_profile() {
  local ncu
  ncu=$(find_ncu) || { echo "gpu_run: ncu (Nsight Compute) not found" >&2; return 127; }
  need bin/bench_gpu || return 127
  local -a args
  mapfile -t args < <(words PROFILE_ARGS)
  # Clocks and caches as they run (no locking, no flushing between kernels).
  bundled "$ncu" --clock-control none --cache-control none --metrics gpu__time_duration.sum \
    --csv --print-kernel-base function --log-file "$PROFILE_CSV" \
    bin/bench_gpu --no-torch --warmup 0 --steps 1 --cuda-graph off "${args[@]}" || return 1
  python3 "$PROFILE_SUMMARY" "$PROFILE_CSV" --top "$PROFILE_TOP"
}

# The bundle against its baseline (bin/baseline), alternating; see `ab` above.
step_ab() {
  local tool side run bin args_var order new_source
  local -a args
  need bin/baseline/COMMIT || return 127
  [[ "$AB_RUNS" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_run: AB_RUNS must be a positive integer" >&2; return 2; }
  mkdir -p "$AB_DIR" && rm -f "$AB_DIR"/*.log
  for tool in $AB_TOOLS; do
    case $tool in
      bench_flash) args_var=AB_FLASH_ARGS ;;
      bench_gpu) args_var=AB_GPU_ARGS ;;
      *) echo "gpu_run: AB_TOOLS: no '$tool' in bin/baseline (bench_flash, bench_gpu)" >&2; return 2 ;;
    esac
    mapfile -t args < <(words "$args_var")
    need "bin/$tool" && need "bin/baseline/$tool" || return 127
    for run in $(seq 1 "$AB_RUNS"); do
      order="baseline new"
      [ $((run % 2)) -eq 0 ] && order="new baseline"
      for side in $order; do
        bin="bin/$tool"
        [ "$side" = baseline ] && bin="bin/baseline/$tool"
        echo "--- $tool, $side build, run $run: $bin ${args[*]}"
        if ! bundled "$bin" "${args[@]}" > "$AB_DIR/$tool.$side.$run.log" 2>&1; then
          echo "FAIL: $bin exited non-zero; its last lines:"
          tail -20 "$AB_DIR/$tool.$side.$run.log" | sed 's/^/  | /'
          return 1
        fi
      done
    done
  done
  new_source=$(sed -n 's/^source: //p' BUNDLE.txt 2>/dev/null)
  python3 "$AB_COMPARE" --baseline "$(cat bin/baseline/COMMIT)" --new "${new_source:-?}" \
    "$AB_DIR"/*.log
}

step_fsdpcpu() {
  local -a args
  mapfile -t args < <(words FSDP_ARGS)
  need bin/bench_fsdp && bundled bin/bench_fsdp --skip-rss "${args[@]}"
}

step_ddpbench() {
  local -a args
  mapfile -t args < <(words DDPBENCH_ARGS)
  need bin/bench_ddp && need bin/worker && need bin/launch || return 127
  if [ "$GPU_RUN_DEVICE" = cpu ]; then
    dry_run_note
    bundled bin/bench_ddp --device cpu --skip-allreduce --skip-torch --skip-overlap \
      --world-of-one gloo --steps 3 --warmup 1 --rounds 2 "${args[@]}"
  else
    bundled bin/bench_ddp --device cuda "${args[@]}"
  fi
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

# --- curve, determinism, resume: training runs compared by their metrics --

# make_config SRC DST SETTING...: SRC (a train.yaml) with each SETTING, which
# is `section.key=value` or a top-level `key=value`, set: an existing line is
# replaced (its comment dropped), a missing key is added to its section (or
# at the end, for a top-level one). Fails on a section SRC does not have.
make_config() {
  local src=$1 dst=$2
  shift 2
  awk -v settings="$(printf '%s\n' "$@")" '
    BEGIN {
      n = split(settings, lines, "\n")
      for (i = 1; i <= n; i++) {
        if (lines[i] == "") continue
        p = index(lines[i], "=")
        if (p < 2) { print "make_config: bad setting " lines[i] > "/dev/stderr"; bad = 1; exit 1 }
        k = substr(lines[i], 1, p - 1)
        want[k] = substr(lines[i], p + 1)
        order[++m] = k
      }
    }
    # The keys of section sec not yet written, at its end.
    function finish(   i, k) {
      for (i = 1; i <= m; i++) {
        k = order[i]
        if (index(k, sec ".") == 1 && !(k in done)) {
          print "  " substr(k, length(sec) + 2) ": " want[k]
          done[k] = 1
        }
      }
    }
    /^[A-Za-z_][A-Za-z0-9_]*:/ {
      if (sec != "") finish()
      key = $0; sub(/:.*/, "", key)
      rest = $0; sub(/^[^:]*:[ \t]*/, "", rest); sub(/[ \t]*#.*/, "", rest)
      sec = (rest == "") ? key : ""
      if (key in want) { print key ": " want[key]; done[key] = 1; next }
      print
      next
    }
    sec != "" && /^  [A-Za-z_][A-Za-z0-9_]*:/ {
      key = $0; sub(/^  /, "", key); sub(/:.*/, "", key)
      if ((sec "." key) in want) { print "  " key ": " want[sec "." key]; done[sec "." key] = 1; next }
    }
    { print }
    END {
      if (bad) exit 1
      if (sec != "") finish()
      for (i = 1; i <= m; i++) {
        k = order[i]
        if (k in done) continue
        if (index(k, ".")) { print "make_config: no section for " k > "/dev/stderr"; status = 1; continue }
        print k ": " want[k]
      }
      exit status
    }' "$src" > "$dst.tmp" || { rm -f "$dst.tmp"; return 1; }
  mv "$dst.tmp" "$dst"
}

# precision_for P: P on cuda; fp32 on the CPU, which computes in fp32 only.
precision_for() {
  if [ "$GPU_RUN_DEVICE" = cpu ]; then echo fp32; else echo "$1"; fi
}

# run_config NAME PRECISION STEPS LOG_EVERY [SETTING...]: writes
# examples/NAME.yaml (examples/tiny.yaml on $GPU_RUN_DEVICE, no evaluation,
# no checkpoints, metrics to out/NAME/metrics.jsonl, `attention: $ATTENTION`
# when that is set and the run is bf16 on the GPU, `train.cuda_graphs:
# $CUDA_GRAPHS` when that is set and the run is on the GPU, the SETTINGs
# last) after emptying out/NAME; prints what it changed.
run_config() {
  local name=$1 precision=$2 nsteps=$3 log_every=$4
  shift 4
  local -a settings=(
    "device=$GPU_RUN_DEVICE" "precision=$precision"
    "train.steps=$nsteps" "train.log_every=$log_every" "train.eval_every=0"
    "train.metrics_file=../out/$name/metrics.jsonl"
    'checkpoint.dir=""' "checkpoint.every=0")
  # ATTENTION (auto, muster, gemm or cudnn): the worker's attention on the GPU,
  # in bf16 (cuDNN's runs in bf16 only; fp32 and tf32 runs keep muster's).
  if [ -n "${ATTENTION:-}" ] && [ "$GPU_RUN_DEVICE" != cpu ] && [ "$precision" = bf16 ]; then
    settings+=("attention=$ATTENTION")
  fi
  # CUDA_GRAPHS (auto, true or false): the worker's train.cuda_graphs on the
  # GPU (unset: the default, auto, which is on there).
  if [ -n "${CUDA_GRAPHS:-}" ] && [ "$GPU_RUN_DEVICE" != cpu ]; then
    settings+=("train.cuda_graphs=$CUDA_GRAPHS")
  fi
  settings+=("$@")
  rm -rf "out/$name" || return 1
  make_config examples/tiny.yaml "examples/$name.yaml" "${settings[@]}" || return 1
  echo "--- examples/$name.yaml: examples/tiny.yaml with ${settings[*]} (later ones win)"
}

need_compare() {
  [ -f "$COMPARE_METRICS" ] || { echo "gpu_run: no $COMPARE_METRICS" >&2; return 127; }
  command -v python3 >/dev/null || { echo "gpu_run: no python3 on PATH" >&2; return 127; }
}

compare_metrics() {
  need_compare || return 127
  echo "--- compare_metrics.py $*"
  python3 "$COMPARE_METRICS" "$@"
}

dry_run_note() {
  [ "$GPU_RUN_DEVICE" = cpu ] || return 0
  echo "gpu_run: GPU_RUN_DEVICE=cpu: a dry run on the CPU, in fp32 throughout"
}

# The bf16 loss curve stays within CURVE_REL of the fp32 one.
step_curve() {
  local p
  need bin/worker && need_compare || return 127
  dry_run_note
  for p in fp32 bf16; do
    run_config "curve_$p" "$(precision_for "$p")" "$CURVE_STEPS" 10 || return 1
    echo "--- bin/worker examples/curve_$p.yaml"
    run_worker "examples/curve_$p.yaml" || return 1
  done
  compare_metrics curve out/curve_fp32/metrics.jsonl out/curve_bf16/metrics.jsonl \
    --after "$CURVE_AFTER" --rel "$CURVE_REL"
}

# The same bf16 run twice: bit-identical losses at every step.
step_determinism() {
  local r
  need bin/worker && need_compare || return 127
  dry_run_note
  for r in a b; do
    run_config "determinism_$r" "$(precision_for bf16)" "$DETERMINISM_STEPS" 1 || return 1
    echo "--- bin/worker examples/determinism_$r.yaml"
    run_worker "examples/determinism_$r.yaml" || return 1
  done
  compare_metrics exact out/determinism_a/metrics.jsonl out/determinism_b/metrics.jsonl
}

# last_step FILE: the step of FILE's last step record (none: 0).
last_step() {
  local s
  s=$(grep '"loss"' "$1" 2>/dev/null | tail -1 | sed -n 's/.*"step":\([0-9]*\).*/\1/p')
  echo "${s:-0}"
}

# resume_attempt STEPS: run A uninterrupted; run B killed with SIGKILL as soon
# as its step-40 checkpoint is committed, then run again (it resumes); B's
# losses after the resume point must equal A's. Returns 3 when B finished
# before it could be killed (too fast to mean anything), 1 on a failure.
resume_attempt() {
  local nsteps=$1 kill_step=40 r pid rc deadline killed_at resumed manifest saved fifo line
  local found out_fd
  local -a settings
  read -r -a settings <<< "$RESUME_MODEL"
  for r in a b; do
    run_config "resume_$r" "$(precision_for bf16)" "$nsteps" 1 \
      "checkpoint.dir=../out/resume_$r/ckpt" checkpoint.every=20 checkpoint.keep_last=3 \
      "${settings[@]}" || return 1
  done
  echo "--- A: bin/worker examples/resume_a.yaml (uninterrupted)"
  run_worker examples/resume_a.yaml || return 1

  # B, in the background: bin/worker itself is the child (env execs it), so
  # $! is the worker's pid. Its output comes through a FIFO, read line by
  # line: the worker prints (and flushes) "checkpoint: saved .../step_N"
  # once that checkpoint is committed, and that line is the event to act on.
  manifest=$(printf 'out/resume_b/ckpt/step_%08d/manifest.json' "$kill_step")
  saved="checkpoint: saved .*/$(printf 'step_%08d' "$kill_step") "
  mkdir -p out/resume_b || return 1
  fifo=out/resume_b/run1.fifo
  rm -f "$fifo" && mkfifo "$fifo" || return 1
  echo "--- B: bin/worker examples/resume_b.yaml in the background; SIGKILL once it reports step $kill_step saved"
  env LD_LIBRARY_PATH="$BUNDLE_LD_PATH" bin/worker examples/resume_b.yaml > "$fifo" 2>&1 &
  pid=$!
  exec {out_fd}< "$fifo"
  : > out/resume_b/run1.log
  deadline=$((SECONDS + 120))
  found=0
  while [ "$SECONDS" -lt "$deadline" ] &&
        IFS= read -r -t $((deadline - SECONDS)) line <&"$out_fd"; do
    printf '%s\n' "$line" >> out/resume_b/run1.log
    if [[ $line =~ $saved ]]; then
      found=1
      break
    fi
  done
  kill -9 "$pid" 2>/dev/null
  # What the worker wrote before it died; EOF once it is gone.
  while IFS= read -r -t 10 line <&"$out_fd"; do
    printf '%s\n' "$line" >> out/resume_b/run1.log
  done
  exec {out_fd}<&-
  rm -f "$fifo"
  # (the braces take bash's own "Killed" notice)
  { wait "$pid"; } 2>/dev/null
  rc=$?
  if [ "$found" -eq 0 ] && [ "$SECONDS" -ge "$deadline" ]; then
    echo "FAIL: B did not report step $kill_step saved within 120 s; B's log:"
    sed 's/^/  | /' out/resume_b/run1.log
    return 1
  fi
  killed_at=$(last_step out/resume_b/metrics.jsonl)
  echo "--- B's first run (exit $rc; last logged step $killed_at of $nsteps):"
  sed 's/^/  | /' out/resume_b/run1.log
  if [ ! -e "$manifest" ]; then
    echo "FAIL: B exited (status $rc) before committing $manifest"
    return 1
  fi
  if [ "$rc" -eq 0 ] || [ "$killed_at" -ge "$nsteps" ]; then
    echo "resume: B finished all $nsteps steps before the kill landed: too fast to test resuming"
    return 3
  fi
  if [ "$rc" -ne 137 ]; then
    echo "FAIL: B's first run exited with status $rc, not 137 (SIGKILL)"
    return 1
  fi
  echo "resume: killed B (SIGKILL) after step $killed_at of $nsteps"
  find out/resume_b/ckpt -mindepth 1 -maxdepth 1 -printf '  ckpt: %f\n' | LC_ALL=C sort

  echo "--- B again: bin/worker examples/resume_b.yaml (resumes)"
  run_worker examples/resume_b.yaml 2>&1 | tee out/resume_b/run2.log
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "FAIL: B's second run exited with status $rc"; return 1; }
  resumed=$(sed -n 's/.*resumed from .* (step \([0-9]*\),.*/\1/p' out/resume_b/run2.log | head -1)
  if [ -z "$resumed" ]; then
    echo "FAIL: B's second run did not resume from a checkpoint (no 'resumed from' line)"
    return 1
  fi
  echo "resume: B resumed from step $resumed (killed after step $killed_at; $nsteps steps)"
  if [ "$resumed" -lt "$kill_step" ] || [ "$resumed" -gt "$killed_at" ]; then
    echo "FAIL: resumed from step $resumed, expected one in $kill_step..$killed_at"
    return 1
  fi
  compare_metrics exact out/resume_a/metrics.jsonl out/resume_b/metrics.jsonl \
    --last-wins --after "$resumed"
}

# Kill and resume: bit-identical continuation. A run too fast to kill in time
# is retried with four times the steps, twice.
step_resume() {
  local nsteps=$RESUME_STEPS attempt rc
  need bin/worker && need_compare || return 127
  dry_run_note
  for attempt in 1 2 3; do
    resume_attempt "$nsteps"
    rc=$?
    [ "$rc" -eq 3 ] || return "$rc"
    [ "$attempt" -lt 3 ] || break
    nsteps=$((nsteps * 4))
    echo "resume: retrying with $nsteps steps"
  done
  echo "FAIL: the run finished before it could be killed, even with $nsteps steps"
  return 1
}

# --- data parallel (issue: NCCL in the worker) -----------------------------

# run_launch NAME ARGS...: bin/launch --standalone ... examples/NAME.yaml,
# output to out/NAME/launch.log.
run_launch() {
  local name=$1
  shift
  mkdir -p "out/$name" || return 1
  echo "--- bin/launch --standalone $* examples/$name.yaml"
  bundled bin/launch --standalone "$@" "examples/$name.yaml" > "out/$name/launch.log" 2>&1
}

# The backend a dry run uses in place of nccl.
nccl_or_dry() {
  if [ "$GPU_RUN_DEVICE" = cpu ]; then echo gloo; else echo nccl; fi
}

step_ddp1() {
  need bin/worker && need_compare || return 127
  dry_run_note
  run_config ddp1_alone "$(precision_for bf16)" 30 1 || return 1
  run_worker examples/ddp1_alone.yaml || return 1
  run_config ddp1_group "$(precision_for bf16)" 30 1 "parallel.backend=$(nccl_or_dry)" || return 1
  (export WORLD_SIZE=1 RANK=0 LOCAL_RANK=0; run_worker examples/ddp1_group.yaml) |
    tee out/ddp1_group.log || return 1
  grep -q "DDP over $(nccl_or_dry)" out/ddp1_group.log ||
    { echo "FAIL: the banner does not name the backend"; return 1; }
  if [ "$GPU_RUN_DEVICE" != cpu ]; then
    grep "NCCL transports:" out/ddp1_group.log ||
      { echo "FAIL: rank 0 did not log NCCL's transports"; return 1; }
  fi
  compare_metrics exact out/ddp1_alone/metrics.jsonl out/ddp1_group/metrics.jsonl
}

step_ddp2() {
  need bin/worker && need bin/launch && need_compare || return 127
  dry_run_note
  # fp32, as in fsdp2 and hsdp: at half the batch the GEMMs have other
  # shapes, for which cuBLASLt may pick other algorithms (other fp32
  # rounding), and in bf16 an activation or weight an fp32 ulp off can round
  # to the next bf16 value, which 1e-5 need not absorb. The gradients are
  # reduced in fp32 in either precision; bf16 DDP is ddp1's and ddpkill's.
  run_config ddp2_one fp32 20 1 data.micro_batch=8 || return 1
  run_worker examples/ddp2_one.yaml || return 1
  run_config ddp2_two fp32 20 1 data.micro_batch=4 parallel.backend=gloo || return 1
  run_launch ddp2_two --nproc_per_node=2 --max_restarts=0 ||
    { sed 's/^/  | /' out/ddp2_two/launch.log; return 1; }
  grep -m1 "DDP over" out/ddp2_two/launch.log
  compare_metrics curve out/ddp2_one/metrics.jsonl out/ddp2_two/metrics.jsonl --after 0 --rel 1e-5
}

step_fsdp1() {
  local zero gather name
  need bin/worker && need_compare || return 127
  dry_run_note
  run_config fsdp1_alone "$(precision_for bf16)" 30 1 || return 1
  run_worker examples/fsdp1_alone.yaml || return 1
  # fp32 gathers compute on the very weights one process does (1e-5);
  # bf16 gathers round every weight the model reads, LayerNorms too, so
  # they follow one process loosely and each other within 1e-5.
  for zero in 1 2 3; do
    for gather in fp32 bf16; do
      name="fsdp1_zero${zero}_$gather"
      run_config "$name" "$(precision_for bf16)" 30 1 parallel.strategy=fsdp \
        "parallel.zero=$zero" "parallel.backend=$(nccl_or_dry)" "parallel.gather_dtype=$gather" ||
        return 1
      (export WORLD_SIZE=1 RANK=0 LOCAL_RANK=0; run_worker "examples/$name.yaml") 2>&1 |
        tee "out/$name.log" || return 1
      grep -q "memory: .*: equal)" "out/$name.log" ||
        { echo "FAIL: $name: no memory line equal to the formula"; return 1; }
    done
    compare_metrics curve out/fsdp1_alone/metrics.jsonl "out/fsdp1_zero${zero}_fp32/metrics.jsonl" \
      --after 0 --rel 1e-5 || return 1
    compare_metrics curve out/fsdp1_alone/metrics.jsonl "out/fsdp1_zero${zero}_bf16/metrics.jsonl" \
      --after 0 --rel 2e-2 || return 1
    compare_metrics curve out/fsdp1_zero1_bf16/metrics.jsonl \
      "out/fsdp1_zero${zero}_bf16/metrics.jsonl" --after 0 --rel 1e-5 || return 1
  done
}

step_fsdp2() {
  local zero
  need bin/worker && need bin/launch && need_compare || return 127
  dry_run_note
  # fp32 against twice the batch at 1e-5: see ddp2.
  run_config fsdp2_one fp32 20 1 data.micro_batch=8 || return 1
  run_worker examples/fsdp2_one.yaml || return 1
  for zero in 2 3; do
    run_config "fsdp2_zero$zero" fp32 20 1 data.micro_batch=4 \
      parallel.strategy=fsdp "parallel.zero=$zero" parallel.backend=gloo \
      parallel.gather_dtype=fp32 || return 1
    run_launch "fsdp2_zero$zero" --nproc_per_node=2 --max_restarts=0 ||
      { sed 's/^/  | /' "out/fsdp2_zero$zero/launch.log"; return 1; }
    grep -m2 "fsdp" "out/fsdp2_zero$zero/launch.log"
    compare_metrics curve out/fsdp2_one/metrics.jsonl "out/fsdp2_zero$zero/metrics.jsonl" \
      --after 0 --rel 1e-5 || return 1
  done
  # bf16 gathers (staged through the host) against a world of one that
  # gathers in bf16 too, at twice the batch: the same rounding, but a master
  # weight an fp32 ulp off (another reduction order) can round to the next
  # bf16 value, so 1e-4 as in fsdp_launch_test, not 1e-5.
  run_config fsdp2_one_bf16 "$(precision_for bf16)" 20 1 data.micro_batch=8 \
    parallel.strategy=fsdp parallel.zero=3 parallel.backend=gloo parallel.gather_dtype=bf16 ||
    return 1
  (export WORLD_SIZE=1 RANK=0 LOCAL_RANK=0; run_worker examples/fsdp2_one_bf16.yaml) || return 1
  run_config fsdp2_zero3_bf16 "$(precision_for bf16)" 20 1 data.micro_batch=4 \
    parallel.strategy=fsdp parallel.zero=3 parallel.backend=gloo parallel.gather_dtype=bf16 ||
    return 1
  run_launch fsdp2_zero3_bf16 --nproc_per_node=2 --max_restarts=0 ||
    { sed 's/^/  | /' out/fsdp2_zero3_bf16/launch.log; return 1; }
  grep -m2 "fsdp" out/fsdp2_zero3_bf16/launch.log
  compare_metrics curve out/fsdp2_one_bf16/metrics.jsonl out/fsdp2_zero3_bf16/metrics.jsonl \
    --after 0 --rel 1e-4 || return 1
}

step_hsdp() {
  need bin/worker && need bin/launch && need_compare || return 127
  dry_run_note
  # fp32 against four times the batch at 1e-5: see ddp2.
  run_config hsdp_one fp32 20 1 data.micro_batch=8 || return 1
  run_worker examples/hsdp_one.yaml || return 1
  run_config hsdp_2x2 fp32 20 1 data.micro_batch=2 parallel.strategy=fsdp \
    parallel.zero=3 parallel.dp_replicate=2 parallel.backend=gloo parallel.gather_dtype=fp32 ||
    return 1
  run_launch hsdp_2x2 --nproc_per_node=4 --max_restarts=0 ||
    { sed 's/^/  | /' out/hsdp_2x2/launch.log; return 1; }
  grep -m2 "fsdp\|FSDP" out/hsdp_2x2/launch.log
  compare_metrics curve out/hsdp_one/metrics.jsonl out/hsdp_2x2/metrics.jsonl --after 0 \
    --rel 1e-5 || return 1
}

# FSDP's overhead on one GPU: with a world of one its all-gathers and
# reduce-scatters are copies, so against DDP (whose all-reduce is one too)
# what differs is FSDP's own work. Runs alternate (A B C D, then D C B A) so
# a drifting clock lands on each alike.
step_fsdpspeed() {
  local round job name
  local -a order runs model
  need bin/worker && need_compare || return 127
  dry_run_note
  if [ "$GPU_RUN_DEVICE" = cpu ]; then
    model=(data.micro_batch=4)  # examples/tiny.yaml's model: the plumbing only
  else
    model=(model.layers=12 model.dim=768 model.heads=12 model.vocab=50257 model.seq_len=1024
           data.micro_batch=8)
  fi
  declare -A settings=(
    [ddp]="parallel.strategy=ddp"
    [zero2]="parallel.strategy=fsdp parallel.zero=2 parallel.gather_dtype=fp32"
    [zero3]="parallel.strategy=fsdp parallel.zero=3 parallel.gather_dtype=fp32"
    [zero3bf16g]="parallel.strategy=fsdp parallel.zero=3 parallel.gather_dtype=bf16")
  for round in 1 2; do
    order=(ddp zero2 zero3 zero3bf16g)
    [ "$round" = 2 ] && order=(zero3bf16g zero3 zero2 ddp)
    for job in "${order[@]}"; do
      name="fsdpspeed_${job}_$round"
      mkdir -p out || return 1
      # shellcheck disable=SC2086  # the settings are words
      run_config "$name" "$(precision_for bf16)" "$FSDPSPEED_STEPS" 1 "${model[@]}" \
        "parallel.backend=$(nccl_or_dry)" ${settings[$job]} || return 1
      (export WORLD_SIZE=1 RANK=0 LOCAL_RANK=0; run_worker "examples/$name.yaml") \
        > "out/$name.log" 2>&1 || { sed 's/^/  | /' "out/$name.log"; return 1; }
      grep -m3 -E "^worker: (GPT|[0-9]+ rank)|memory:" "out/$name.log"
    done
  done
  for job in ddp zero2 zero3 zero3bf16g; do
    runs+=("out/fsdpspeed_${job}_1/metrics.jsonl,out/fsdpspeed_${job}_2/metrics.jsonl")
  done
  compare_metrics speed "${runs[@]}" --after 10
}

step_ddpnccl2() {
  local gpus start rc took
  need bin/worker && need bin/launch || return 127
  if [ "$GPU_RUN_DEVICE" = cpu ]; then
    echo "ddpnccl2: skipped in a dry run (NCCL needs a GPU)"
    return 0
  fi
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  run_config ddpnccl2 bf16 20 1 data.micro_batch=4 parallel.backend=nccl parallel.timeout_s=60 ||
    return 1
  start=$SECONDS
  run_launch ddpnccl2 --nproc_per_node=2 --max_restarts=0
  rc=$?
  took=$((SECONDS - start))
  sed 's/^/  | /' out/ddpnccl2/launch.log | tail -40
  echo "ddpnccl2: $gpus GPU(s); launch exited $rc after ${took} s"
  if [ "$gpus" -ge 2 ]; then
    [ "$rc" -eq 0 ] || { echo "FAIL: 2 ranks on 2 GPUs over NCCL did not train"; return 1; }
    return 0
  fi
  [ "$rc" -ne 0 ] || { echo "FAIL: 2 ranks on one GPU over NCCL were not refused"; return 1; }
  [ "$took" -le 60 ] || { echo "FAIL: the refusal took ${took} s"; return 1; }
  grep -qi "nccl" out/ddpnccl2/launch.log ||
    { echo "FAIL: the error does not name NCCL"; return 1; }
  echo "PASS: refused in ${took} s, naming NCCL"
}

# pid_with_env PARENT ENTRY: a descendant of PARENT whose environment holds
# ENTRY exactly (e.g. RANK=1), running bin/worker.
pid_with_env() {
  local parent=$1 entry=$2 p
  for p in $(pgrep -f 'bin/worker' 2>/dev/null); do
    [ "$p" != "$parent" ] || continue
    tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "$entry" && { echo "$p"; return 0; }
  done
  return 1
}

step_ddpkill() {
  local pid line fifo out_fd found deadline rank0 rank1 killed_at gone_at rc waited took
  need bin/worker && need bin/launch && need_compare || return 127
  dry_run_note
  local -a common=(data.micro_batch=4 parallel.backend=gloo checkpoint.every=10
                   checkpoint.keep_last=3)
  run_config ddpkill_a "$(precision_for bf16)" 40 1 "${common[@]}" \
    "checkpoint.dir=../out/ddpkill_a/ckpt" || return 1
  run_launch ddpkill_a --nproc_per_node=2 --max_restarts=0 ||
    { sed 's/^/  | /' out/ddpkill_a/launch.log; return 1; }
  run_config ddpkill_b "$(precision_for bf16)" 40 1 "${common[@]}" \
    "checkpoint.dir=../out/ddpkill_b/ckpt" || return 1
  mkdir -p out/ddpkill_b || return 1
  fifo=out/ddpkill_b/launch.fifo
  rm -f "$fifo" && mkfifo "$fifo" || return 1
  echo "--- bin/launch --standalone --nproc_per_node=2 --max_restarts=1 examples/ddpkill_b.yaml (background)"
  env LD_LIBRARY_PATH="$BUNDLE_LD_PATH" bin/launch --standalone --nproc_per_node=2 \
    --max_restarts=1 examples/ddpkill_b.yaml > "$fifo" 2>&1 &
  pid=$!
  exec {out_fd}< "$fifo"
  : > out/ddpkill_b/launch.log
  deadline=$((SECONDS + 120))
  found=0
  while [ "$SECONDS" -lt "$deadline" ] &&
        IFS= read -r -t $((deadline - SECONDS)) line <&"$out_fd"; do
    printf '%s\n' "$line" >> out/ddpkill_b/launch.log
    if [[ $line =~ checkpoint:\ saved\ .*step_00000010 ]]; then found=1; break; fi
  done
  # The rest of the output, in the background, until launch closes it.
  cat <&"$out_fd" >> out/ddpkill_b/launch.log &
  exec {out_fd}<&-
  # On failure, SIGTERM lets launch stop its workers (SIGKILL would leave
  # them running until the step's timeout kills the group).
  [ "$found" -eq 1 ] || { echo "FAIL: no step-10 checkpoint within 120 s"; kill "$pid"; return 1; }
  rank0=$(pid_with_env "$pid" RANK=0) && rank1=$(pid_with_env "$pid" RANK=1) ||
    { echo "FAIL: cannot find the two workers"; kill "$pid"; return 1; }
  killed_at=$(date +%s.%N)
  kill -9 "$rank1"
  # /proc announces no exit to a non-parent: poll it, for at most 10 s.
  waited=0
  while kill -0 "$rank0" 2>/dev/null && [ "$waited" -lt 500 ]; do
    sleep 0.02
    waited=$((waited + 1))
  done
  gone_at=$(date +%s.%N)
  wait "$pid"
  rc=$?
  wait
  rm -f "$fifo"
  took=$(awk -v a="$killed_at" -v b="$gone_at" 'BEGIN { printf "%.3f", b - a }')
  echo "ddpkill: rank 0 gone $took s after rank 1 was killed (launch stops it too); launch exited $rc"
  grep -E "workers failed|round .* ended|UNAVAILABLE|restart" out/ddpkill_b/launch.log | head -8
  awk -v t="$took" 'BEGIN { exit !(t < 2.0) }' || { echo "FAIL: rank 0 took ${took} s (>= 2 s)"; return 1; }
  [ "$rc" -eq 0 ] || { echo "FAIL: the restarted job did not finish"; sed 's/^/  | /' out/ddpkill_b/launch.log | tail -30; return 1; }
  compare_metrics exact out/ddpkill_a/metrics.jsonl out/ddpkill_b/metrics.jsonl --last-wins
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
    export -f bundled run_worker words need find_cuda_tool find_sanitizer find_ncu "step_$step" \
      make_config precision_for run_config need_compare compare_metrics dry_run_note \
      last_step resume_attempt run_launch nccl_or_dry pid_with_env
    export BUNDLE_LD_PATH CUDNN_LIB MUSTER_HOME TRAIN_CONFIGS COMPARE_METRICS GPU_RUN_DEVICE \
      CURVE_STEPS CURVE_AFTER CURVE_REL DETERMINISM_STEPS RESUME_STEPS RESUME_MODEL \
      FSDPSPEED_STEPS DDPBENCH_ARGS AB_COMPARE AB_DIR AB_TOOLS AB_RUNS AB_FLASH_ARGS AB_GPU_ARGS \
      PROFILE_ARGS PROFILE_TOP PROFILE_CSV PROFILE_SUMMARY
    # pipefail again: a child bash does not inherit it, and a step's
    # `run_worker ... | tee` must fail when the worker does.
    timeout -k 10 "$STEP_TIMEOUT" bash -c "set -o pipefail; step_$step"
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
printf '%-12s %-16s %9s\n' step result seconds
failed=0
for i in "${!names[@]}"; do
  printf '%-12s %-16s %9s\n' "${names[$i]}" "${results[$i]}" "${seconds[$i]}"
  [ "${results[$i]}" = pass ] || failed=$((failed + 1))
done
echo "$((${#names[@]} - failed)) passed, $failed failed"
[ $failed -eq 0 ]
