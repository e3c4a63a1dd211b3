#!/usr/bin/env bash
# The rendezvous demo: a rendezvous service, two `launch` agents acting as
# two nodes with two (shell) workers each, inspected live with `rdzvctl`.
# Everything runs on 127.0.0.1 and stops by itself within seconds.
# scripts/demo.sh runs it after the training demo.
# BAZEL (default "bazel") and BAZEL_BUILD_FLAGS choose how things are built.
set -euo pipefail
cd "$(dirname "$0")/.."

BAZEL=${BAZEL:-bazel}
read -r -a build_flags <<< "${BAZEL_BUILD_FLAGS:-}"
bash scripts/setup.sh
$BAZEL build "${build_flags[@]}" //rendezvous:rendezvous //tools:rdzvctl //launcher:launch
BIN=$($BAZEL info "${build_flags[@]}" bazel-bin 2>/dev/null)

work=$(mktemp -d /tmp/muster-demo.XXXXXX)
cleanup() {
  [ -n "${server_pid:-}" ] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

echo "== starting the rendezvous service (state in $work/state)"
"$BIN/rendezvous/rendezvous" --listen 127.0.0.1:0 --state-dir "$work/state" \
  --log-level warn > "$work/server.out" &
server_pid=$!
for _ in $(seq 100); do
  grep -q "listening on" "$work/server.out" 2>/dev/null && break
  sleep 0.1
done
endpoint=$(sed -n 's/^rendezvous: listening on //p' "$work/server.out")
echo "   listening on $endpoint"
rdzvctl() { "$BIN/tools/rdzvctl" --endpoint "$endpoint" "$@"; }
rdzvctl health

# Each worker says hello, waits for the demo to look at it, and finishes.
worker='echo "rank $RANK of $WORLD_SIZE on node $GROUP_RANK, master $MASTER_ADDR:$MASTER_PORT";
        while [ ! -e '"$work"'/go ]; do sleep 0.1; done; echo "rank $RANK done"'

echo "== two agents (nodes) with two workers each join job 'demo'"
for node in 0 1; do
  "$BIN/launcher/launch" --nnodes=2 --nproc_per_node=2 --rdzv_endpoint="$endpoint" \
    --rdzv_id=demo --no_python /bin/sh -c "$worker" &
  agents[$node]=$!
done

for _ in $(seq 100); do
  rdzvctl describe demo 2>/dev/null | grep -q RUNNING && break
  sleep 0.1
done
echo "== rdzvctl list"
rdzvctl list
echo "== rdzvctl describe demo"
rdzvctl describe demo

touch "$work/go"
status=0
for pid in "${agents[@]}"; do wait "$pid" || status=$?; done
echo "== after the job: rdzvctl list"
rdzvctl list
echo "== demo finished: agents exited with status $status"
exit $status
