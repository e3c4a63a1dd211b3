#!/usr/bin/env bash
# Runs every test: installs what is missing, then `bazel test //...`, then,
# when nvcc is on this machine, builds the CUDA path (--config=cuda) so CI
# proves it compiles and links, and runs the CUDA-config tests that need
# no GPU (the kernels under the CPU emulation, its race and memory checkers,
# and the cuDNN descriptor test).
# Exits non-zero on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh --test || { echo "test: set-up failed" >&2; exit 1; }

status=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT

bazel test --keep_going //... 2>&1 | tee "$log"
test_rc=${PIPESTATUS[0]}
[ "$test_rc" -eq 0 ] || status=1

passed=$(grep -cE '^//[^ ]+ .*PASSED' "$log" || true)
failed=$(grep -cE '^//[^ ]+ .*(FAILED|TIMEOUT|NO STATUS|INCOMPLETE)' "$log" || true)
if [ "$test_rc" -ne 0 ] && [ "$failed" -eq 0 ]; then
  failed=1  # the build itself failed
fi

if [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "test: building the CUDA path (--config=cuda)"
  # The GPU tests are manual (they need a GPU to run): build them here so
  # CI proves they compile and link; scripts/gpu_run.sh runs them on a GPU.
  if bazel build --config=cuda //... //kernels:cuda_link_check \
      //tests/kernels:fast_cuda_test //tests/worker/model:model_cuda_test \
      //tests/parallel:staged_group_cuda_test //parallel/nccl:nccl_link_check \
      //tools:bench_flash //tools:bench_gemm; then
    passed=$((passed + 1))
  else
    echo "test: --config=cuda build FAILED" >&2
    failed=$((failed + 1))
    status=1
  fi
  # The CUDA-config tests that need no GPU: cuDNN checks the attention
  # graphs' descriptors (tests/kernels/cudnn_descriptors_test.cc), and the
  # hand-written kernels run on the CPU emulation of kernels/simt:
  # fast_cuda_test.cc's cases that need no cuBLASLt or cuDNN
  # (fast_simt_test), and flash attention under other thread schedules
  # (simt_test.cc).
  # fast_simt_test's cases other than flash attention (which simt_test
  # covers) run again with one warp running ahead of the others, both ways
  # (kernels/simt/simt.h, Schedule), to find a missing barrier.
  # Then the emulation's checkers (simt.h): the race checker's own test,
  # and fast_cuda_test.cc's cases under the race checker (ThreadSanitizer:
  # any race fails) and the memory checker (AddressSanitizer: any access
  # out of bounds fails). The sanitizers need their fixed address layout;
  # where the kernel randomises mmap more than they expect, turning
  # randomisation off for the test process avoids that (setarch -R, used
  # where it is allowed).
  checker_env=""
  if setarch "$(uname -m)" -R true 2> /dev/null; then
    checker_env="--run_under=setarch $(uname -m) -R"
  fi
  for run in "//tests/kernels:cudnn_descriptors_test" "//tests/kernels:fast_simt_test" \
      "//tests/kernels:simt_test" \
      "//tests/kernels:fast_simt_test --test_env=MUSTER_SIMT_SCHEDULE=lowest_first --test_arg=~[attention]" \
      "//tests/kernels:fast_simt_test --test_env=MUSTER_SIMT_SCHEDULE=highest_first --test_arg=~[attention]" \
      "//tests/kernels:simt_race_test" "//tests/kernels:fast_simt_race_test" \
      "//tests/kernels:fast_simt_memcheck_test"; do
    read -r -a words <<< "$run"
    if [[ "$run" == *_race_test || "$run" == *_memcheck_test ]] && [ -n "$checker_env" ]; then
      words+=("$checker_env")
    fi
    if bazel test --config=cuda --test_output=errors "${words[@]}"; then
      passed=$((passed + 1))
    else
      echo "test: $run FAILED" >&2
      failed=$((failed + 1))
      status=1
    fi
  done
else
  echo "test: no nvcc at /usr/local/cuda/bin/nvcc; skipping the CUDA build"
fi

echo "${passed} passed, ${failed} failed"
exit $status
