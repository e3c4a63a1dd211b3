#!/usr/bin/env bash
# Builds the CUDA path here (-c opt --config=cuda) and packs the GPU binaries,
# the shared libraries Debian provides for them, the example configs and a
# small token data set into one relocatable tarball for a GPU node:
#
#   OUTDIR/muster/bin/       worker, launch, bench_gpu, bench_flash, bench_gemm, bench_ddp,
#                            bench_fsdp (CPU), cuda_link_check, the CUDA tests
#                            (RPATH $ORIGIN/../lib), bench_gpu_torch.py,
#                            bench_flash_torch.py, bench_gemm_torch.py
#   OUTDIR/muster/bin/baseline/  with BASELINE=<commit> only: bench_gpu and
#                            bench_flash built from that commit (COMMIT names
#                            it), for gpu_run.sh's `ab` step: the same benches
#                            of two builds, alternating on one GPU
#   OUTDIR/muster/lib/       their shared libraries (RPATH $ORIGIN), less the
#                            ones the node must provide itself (see EXCLUDED)
#   OUTDIR/muster/examples/  examples/*.yaml
#   OUTDIR/muster/data/tiny/ byte-level token shards that examples/tiny.yaml reads
#   OUTDIR/muster-gpu.tar.xz all of the above (fails if over 40 MiB)
#
# scripts/gpu_run.sh unpacks and runs it on the node; docs/gpu.md has the rest.
# Idempotent: every run rebuilds OUTDIR/muster and the tarball from scratch.
#
# Usage: gpu_bundle.sh [OUTDIR]          (default .gpu, git-ignored)
# Environment:
#   GPU_TARGETS  space-separated Bazel labels, overriding GPU_TARGETS_DEFAULT
#   BAZEL        the bazel command (default "bazel")
#   DATA_BYTES   bytes of demo text tokenized into data/tiny (default 1000000)
#   BASELINE     a commit (any name git knows) to build the baseline benches
#                from, in a git worktree at BASELINE_TREE (default
#                /tmp/muster-baseline, kept between runs: its Bazel output
#                base makes the next baseline build incremental)
set -euo pipefail
cd "$(dirname "$0")/.."

# The binaries the bundle carries: cc_binary and cc_test labels. Each must
# build under -c opt --config=cuda; its output is bazel-bin/<package>/<name>.
GPU_TARGETS_DEFAULT=(
  //worker:worker
  //launcher:launch
  //parallel/nccl:nccl_link_check
  //tools:bench_gpu
  //tools:bench_flash
  //tools:bench_gemm
  //tools:bench_fsdp
  //tools:bench_ddp
  //kernels:cuda_link_check
  //tests/kernels:fast_cuda_test
  //tests/worker/model:model_cuda_test
  //tests/parallel:staged_group_cuda_test
)

# Libraries the node provides and the bundle must not: glibc (its version must
# match the node's dynamic loader), the compiler runtime (a Debian libstdc++
# in front of the node's would break its Python and PyTorch), and cuBLAS and
# NCCL (the node's own, matched to its driver and fabric). Patterns match the
# soname a binary asks for.
EXCLUDED=(
  'linux-vdso.so*' 'ld-linux*.so*'
  'libc.so*' 'libm.so*' 'libmvec.so*' 'libpthread.so*' 'libdl.so*' 'librt.so*'
  'libutil.so*' 'libresolv.so*' 'libanl.so*' 'libnsl.so*' 'libnss_*'
  'libstdc++.so*' 'libgcc_s.so*'
  'libcublas.so*' 'libcublasLt.so*' 'libnccl.so*'
  'libcuda.so*' 'libnvidia-*'
)

MAX_TARBALL_BYTES=$((40 * 1024 * 1024))
MAX_DATA_BYTES=$((5 * 1000 * 1000))
NVCC=/usr/local/cuda/bin/nvcc
CUDA_LIB=/usr/local/cuda/lib64

die() {
  echo "gpu_bundle: ERROR: $*" >&2
  exit 1
}
on_error() {
  local rc=$?
  echo "gpu_bundle: ERROR: failed (exit $rc) at line $1: $2" >&2
  exit "$rc"
}
trap 'on_error "$LINENO" "$BASH_COMMAND"' ERR

outdir=${1:-.gpu}
mkdir -p "$outdir"
outdir=$(cd "$outdir" && pwd -P)
stage="$outdir/muster"
tarball="$outdir/muster-gpu.tar.xz"
BAZEL=${BAZEL:-bazel}
build_flags=(-c opt --config=cuda)
if [ -n "${GPU_TARGETS:-}" ]; then
  read -r -a targets <<< "$GPU_TARGETS"
else
  targets=("${GPU_TARGETS_DEFAULT[@]}")
fi
[ ${#targets[@]} -gt 0 ] || die "no targets (GPU_TARGETS is blank)"
data_bytes=${DATA_BYTES:-1000000}
if ! [[ "$data_bytes" =~ ^[1-9][0-9]*$ ]]; then
  die "DATA_BYTES must be a positive integer"
fi

echo "== set-up (scripts/setup.sh, patchelf, xz-utils, fortunes)"
[ -x "$NVCC" ] || die "no nvcc at $NVCC: the CUDA toolkit is needed to build the GPU path"
[ -e "$CUDA_LIB/libcudart.so" ] || die "no $CUDA_LIB/libcudart.so"
bash scripts/setup.sh || die "scripts/setup.sh failed"
missing=()
# patchelf rewrites RPATHs, xz-utils packs, fortunes is the demo text
# (as in scripts/make_demo_data.sh).
for pkg in patchelf xz-utils fortunes fortunes-min binutils; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "gpu_bundle: installing ${missing[*]}" >&2
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq || die "apt-get update failed"
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
    die "apt-get install ${missing[*]} failed"
fi
for tool in patchelf xz strip readelf ldd tar; do
  command -v "$tool" >/dev/null || die "$tool not found"
done

echo "== $BAZEL build ${build_flags[*]} ${targets[*]} //tools:mkdata"
"$BAZEL" build "${build_flags[@]}" "${targets[@]}" //tools:mkdata ||
  die "bazel build failed (targets: ${targets[*]})"
bazel_bin=$("$BAZEL" info "${build_flags[@]}" bazel-bin 2>/dev/null) ||
  die "bazel info bazel-bin failed"

# //pkg/sub:name -> BIN/pkg/sub/name (cc_binary and cc_test alike), BIN
# the second argument or this tree's bazel-bin.
binary_of() {
  local label=$1 bin=${2:-$bazel_bin} pkg name
  [[ "$label" == //*:* ]] || die "target '$label' is not of the form //package:name"
  pkg=${label#//}
  pkg=${pkg%%:*}
  name=${label##*:}
  echo "$bin/$pkg/$name"
}

is_excluded() {
  local soname=$1 pattern
  for pattern in "${EXCLUDED[@]}"; do
    # shellcheck disable=SC2053  # the pattern is a glob on purpose
    [[ "$soname" == $pattern ]] && return 0
  done
  return 1
}

echo "== staging $stage"
rm -rf "$stage" "$tarball" "$tarball.tmp"
mkdir -p "$stage/bin" "$stage/lib" "$stage/examples" "$stage/data"

bins=()
srcs=()
for label in "${targets[@]}"; do
  src=$(binary_of "$label")
  if [ ! -f "$src" ] || [ ! -x "$src" ]; then
    die "$label built, but there is no executable at $src"
  fi
  dst="$stage/bin/$(basename "$src")"
  [ -e "$dst" ] && die "two targets named $(basename "$src")"
  cp -L "$src" "$dst"
  chmod u+w,a+rx "$dst"
  bins+=("$dst")
  srcs+=("$src")
done

# The baseline benches (BASELINE): the same targets built from another
# commit in a worktree of this repository, with its own Bazel output base.
BASELINE_TARGETS=(//tools:bench_gpu //tools:bench_flash)
base_bins=()
if [ -n "${BASELINE:-}" ]; then
  base_sha=$(git rev-parse --verify --quiet "${BASELINE}^{commit}") ||
    die "BASELINE=$BASELINE is not a commit of this repository"
  base_tree=${BASELINE_TREE:-/tmp/muster-baseline}
  echo "== baseline $base_sha in $base_tree"
  if [ -e "$base_tree/.git" ]; then
    git -C "$base_tree" checkout --quiet --detach "$base_sha" ||
      die "cannot check out $base_sha in $base_tree (not a worktree of this repository?)"
  else
    [ ! -e "$base_tree" ] || die "$base_tree exists and is not a git worktree; set BASELINE_TREE"
    git worktree prune  # a worktree whose folder was deleted (a cleaned /tmp)
    git worktree add --quiet --detach "$base_tree" "$base_sha" ||
      die "git worktree add $base_tree failed"
  fi
  (cd "$base_tree" && "$BAZEL" build "${build_flags[@]}" "${BASELINE_TARGETS[@]}") ||
    die "the baseline's bazel build failed"
  base_bazel_bin=$(cd "$base_tree" && "$BAZEL" info "${build_flags[@]}" bazel-bin 2>/dev/null) ||
    die "bazel info bazel-bin failed in $base_tree"
  # Its Bazel server is not needed again until the next baseline build.
  (cd "$base_tree" && "$BAZEL" shutdown) || true
  mkdir -p "$stage/bin/baseline"
  for label in "${BASELINE_TARGETS[@]}"; do
    src=$(binary_of "$label" "$base_bazel_bin")
    [ -x "$src" ] || die "the baseline built $label, but there is no executable at $src"
    dst="$stage/bin/baseline/${label##*:}"
    cp -L "$src" "$dst"
    chmod u+w,a+rx "$dst"
    base_bins+=("$dst")
    srcs+=("$src")
  done
  echo "$base_sha" > "$stage/bin/baseline/COMMIT"
fi

# Every library the binaries load, transitively (ldd resolves the whole tree),
# by the soname they ask for, resolved the way this machine resolves it. ldd
# runs on the binaries where Bazel left them: cc_test binaries load the
# workspace's own libraries (bazel-bin/_solib_k8/lib*.so) through a RUNPATH
# relative to $ORIGIN; those travel in lib/ too.
declare -A lib_path=()
for src in "${srcs[@]}"; do
  ldd_out=$(env -u LD_LIBRARY_PATH -u LD_PRELOAD ldd "$src" 2>&1) || die "ldd $src failed: $ldd_out"
  if grep -q 'not found' <<< "$ldd_out"; then
    die "$(basename "$src") has unresolved libraries here:
$(grep 'not found' <<< "$ldd_out")"
  fi
  while read -r soname arrow path _; do
    [ "$arrow" = "=>" ] || continue           # linux-vdso, the loader itself
    is_excluded "$soname" && continue
    [ -f "$path" ] || die "ldd names $path for $soname, which is not a file"
    lib_path[$soname]=$path
  done <<< "$ldd_out"
done
if [ -z "${lib_path[libcudart.so.13]:-}" ]; then
  echo "gpu_bundle: warning: no binary loads libcudart.so.13 (built without CUDA?)" >&2
fi

for soname in $(printf '%s\n' "${!lib_path[@]}" | LC_ALL=C sort); do
  cp -L "${lib_path[$soname]}" "$stage/lib/$soname"
  chmod u+w,a+r "$stage/lib/$soname"
done

# Strip first, then set DT_RPATH (not RUNPATH: DT_RPATH of the executable
# also applies to the libraries its libraries load).
for f in "${bins[@]}" "${base_bins[@]}" "$stage"/lib/*; do
  [ -f "$f" ] || continue
  strip --strip-debug "$f" || die "strip --strip-debug $f failed"
done
# shellcheck disable=SC2016  # $ORIGIN is for the dynamic loader, not the shell
for bin in "${bins[@]}"; do
  patchelf --force-rpath --set-rpath '$ORIGIN/../lib' "$bin" || die "patchelf $bin failed"
done
# shellcheck disable=SC2016
for bin in "${base_bins[@]}"; do
  patchelf --force-rpath --set-rpath '$ORIGIN/../../lib' "$bin" || die "patchelf $bin failed"
done
# shellcheck disable=SC2016
for lib in "$stage"/lib/*; do
  [ -f "$lib" ] || continue
  patchelf --force-rpath --set-rpath '$ORIGIN' "$lib" || die "patchelf $lib failed"
done

# Check: with the bundle's RPATH, every non-excluded library resolves from
# the bundle. cuBLAS and NCCL resolve from this machine's CUDA.
check_path="$CUDA_LIB"
for bin in "${bins[@]}" "${base_bins[@]}"; do
  ldd_out=$(env -u LD_PRELOAD LD_LIBRARY_PATH="$check_path" ldd "$bin" 2>&1) ||
    die "ldd of the bundled $(basename "$bin") failed: $ldd_out"
  grep -q 'not found' <<< "$ldd_out" && die "bundled $(basename "$bin") does not resolve:
$ldd_out"
  while read -r soname arrow path _; do
    [ "$arrow" = "=>" ] || continue
    is_excluded "$soname" && continue
    [ "$(realpath "$path")" = "$(realpath "$stage/lib/$soname")" ] ||
      die "bundled $(basename "$bin") loads $soname from $path, not from the bundle"
  done <<< "$ldd_out"
done

for peer in tools/bench_gpu_torch.py tools/bench_flash_torch.py tools/bench_gemm_torch.py; do
  if [ -f "$peer" ]; then cp "$peer" "$stage/bin/"; fi
done
cp examples/*.yaml "$stage/examples/"

echo "== demo data: $data_bytes bytes of fortunes text -> $stage/data/tiny"
# The texts scripts/make_demo_data.sh uses, in the same order, cut to
# DATA_BYTES so the bundle stays small (2 bytes per token).
mapfile -t texts < <(dpkg -L fortunes fortunes-min | grep '^/usr/share/games/fortunes/' |
  grep -v -e '\.dat$' -e '\.u8$' -e '/art$' -e '/ascii-art$' |
  while read -r path; do [ -f "$path" ] && [ ! -L "$path" ] && echo "$path"; done |
  LC_ALL=C sort)
[ ${#texts[@]} -gt 0 ] || die "no fortune files under /usr/share/games/fortunes"
text="$outdir/demo_text.txt"
# head closes the pipe early; cat's SIGPIPE is expected, not an error.
(cat "${texts[@]}" 2>/dev/null || true) | head -c "$data_bytes" > "$text"
[ -s "$text" ] || die "could not read the fortune texts"
"$bazel_bin/tools/mkdata" --out "$stage/data/tiny" --val-fraction 0.1 "$text" ||
  die "mkdata failed"
rm -f "$text"
data_size=$(du -sb "$stage/data" | cut -f1)
[ "$data_size" -le "$MAX_DATA_BYTES" ] ||
  die "data is $data_size bytes, over $MAX_DATA_BYTES; lower DATA_BYTES"

# What the node's own libraries must offer: the newest glibc and libstdc++
# symbol versions the bundle asks for.
need_versions() {
  local prefix=$1
  for f in "${bins[@]}" "$stage"/lib/*; do
    readelf -V --wide "$f" 2>/dev/null | grep -o "Name: ${prefix}_[0-9.]*" || true
  done | sed 's/Name: //' | sort -u -V | tail -1
}
{
  echo "muster GPU bundle"
  echo "source: $(git describe --always --dirty 2>/dev/null || echo unknown)"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(grep -oP '^PRETTY_NAME="?\K[^"]*' /etc/os-release)"
  echo "bazel: ${build_flags[*]} ${targets[*]}"
  if [ ${#base_bins[@]} -gt 0 ]; then
    echo "baseline: $base_sha (bin/baseline: ${BASELINE_TARGETS[*]})"
  fi
  echo "needs from the node: ${EXCLUDED[*]}"
  echo "newest symbol versions needed: $(need_versions GLIBC) $(need_versions GLIBCXX) $(need_versions CXXABI)"
  echo "bin:"
  find "$stage/bin" -mindepth 1 -maxdepth 1 -printf '  %f\n' | LC_ALL=C sort
  echo "lib:"
  for soname in $(printf '%s\n' "${!lib_path[@]}" | LC_ALL=C sort); do
    echo "  $soname  (from ${lib_path[$soname]})"
  done
} > "$stage/BUNDLE.txt"

echo "== packing $tarball"
tar -C "$outdir" --owner=0 --group=0 --numeric-owner -cf - muster |
  xz -T0 -6 > "$tarball.tmp" || die "tar | xz failed"
mv "$tarball.tmp" "$tarball"

size=$(stat -c %s "$tarball")
echo "gpu_bundle: ${#bins[@]} binaries, ${#lib_path[@]} libraries, data $((data_size / 1024)) KiB"
echo "gpu_bundle: $tarball is $size bytes ($(awk -v s="$size" 'BEGIN { printf "%.1f", s / 1048576 }') MiB; unpacked $(du -sh "$stage" | cut -f1))"
if [ "$size" -gt "$MAX_TARBALL_BYTES" ]; then
  die "the tarball is over 40 MiB ($size bytes)"
fi
