#!/usr/bin/env bash
# The demo job, about two minutes on 2 CPU cores:
#   1. set-up: Debian packages (scripts/setup.sh) and the demo data,
#      data/tiny/*.bin, byte-level shards of fortune-cookie text
#      (scripts/make_demo_data.sh; skipped when present);
#   2. `launch --standalone --nproc_per_node=2 examples/tiny.yaml`: two
#      workers train a 0.8M-parameter byte-level GPT data-parallel (DDP over
#      Gloo) for 250 steps, logging loss, throughput and MFU, writing
#      out/tiny/metrics.jsonl and sharded checkpoints (steps 100, 200, 250;
#      keep_last 2 leaves 200 and 250);
#   3. `ckpt ls` and `ckpt verify` on those checkpoints;
#   4. `worker generate --checkpoint`: samples text from the last one;
#   5. scripts/demo_rendezvous.sh: two `launch` agents as two nodes against
#      a rendezvous service, inspected with `rdzvctl` (a few seconds).
# BAZEL (default "bazel") and BAZEL_BUILD_FLAGS choose how things are built;
# DEMO_PROMPT changes the prompt.
set -euo pipefail
cd "$(dirname "$0")/.."

BAZEL=${BAZEL:-bazel}
read -r -a build_flags <<< "${BAZEL_BUILD_FLAGS:-}"
prompt=${DEMO_PROMPT:-"The secret of life is "}

echo "== set-up"
bash scripts/setup.sh
if ! ls data/tiny/train_*.bin data/tiny/val_*.bin >/dev/null 2>&1; then
  BAZEL="$BAZEL" bash scripts/make_demo_data.sh data/tiny
fi
$BAZEL build "${build_flags[@]}" //launcher:launch //worker:worker //tools:ckpt
BIN=$($BAZEL info "${build_flags[@]}" bazel-bin 2>/dev/null)

# A fresh run each time: with checkpoint.resume auto, a second demo would
# otherwise resume from step 250 and have nothing left to train.
rm -rf out/tiny
echo "== launch --standalone --nproc_per_node=2 examples/tiny.yaml"
"$BIN/launcher/launch" --standalone --nproc_per_node=2 examples/tiny.yaml
echo "   metrics: out/tiny/metrics.jsonl ($(wc -l < out/tiny/metrics.jsonl) lines)"

echo "== ckpt ls out/tiny/checkpoints; ckpt verify the last one"
"$BIN/tools/ckpt" ls out/tiny/checkpoints
"$BIN/tools/ckpt" verify out/tiny/checkpoints/step_00000250

echo "== worker generate --checkpoint out/tiny/checkpoints/step_00000250 --prompt \"$prompt\""
if ! "$BIN/worker/worker" generate --config examples/tiny.yaml \
    --checkpoint out/tiny/checkpoints/step_00000250 --prompt "$prompt" \
    --tokens 300 --temperature 0.8 --seed 1 2> out/tiny/generate.log; then
  cat out/tiny/generate.log >&2
  exit 1
fi

echo "== the rendezvous service with two nodes (scripts/demo_rendezvous.sh)"
bash scripts/demo_rendezvous.sh
