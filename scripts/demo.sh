#!/usr/bin/env bash
# The demo job, about two minutes on 2 CPU cores:
#   1. set-up: Debian packages (scripts/setup.sh) and the demo data,
#      data/tiny/*.bin, byte-level shards of fortune-cookie text
#      (scripts/make_demo_data.sh; skipped when present);
#   2. `launch --standalone --nproc_per_node=1 examples/tiny.yaml`: one
#      worker trains a 0.8M-parameter byte-level GPT for 250 steps, logging
#      loss, throughput and MFU, and writing out/tiny/metrics.jsonl;
#   3. `worker generate`: samples text from that model. There are no
#      checkpoints yet, so generate trains it again first; training is
#      deterministic, so it is bit for bit the model step 2 trained;
#   4. scripts/demo_rendezvous.sh: two `launch` agents as two nodes against
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
$BAZEL build "${build_flags[@]}" //launcher:launch //worker:worker
BIN=$($BAZEL info "${build_flags[@]}" bazel-bin 2>/dev/null)

echo "== launch --standalone --nproc_per_node=1 examples/tiny.yaml"
"$BIN/launcher/launch" --standalone --nproc_per_node=1 examples/tiny.yaml
echo "   metrics: out/tiny/metrics.jsonl ($(wc -l < out/tiny/metrics.jsonl) lines)"

echo "== worker generate --config examples/tiny.yaml --prompt \"$prompt\""
echo "   (retraining first; its log goes to out/tiny/generate.log)"
if ! "$BIN/worker/worker" generate --config examples/tiny.yaml --prompt "$prompt" \
    --tokens 300 --temperature 0.8 --seed 1 2> out/tiny/generate.log; then
  cat out/tiny/generate.log >&2
  exit 1
fi

echo "== the rendezvous service with two nodes (scripts/demo_rendezvous.sh)"
bash scripts/demo_rendezvous.sh
