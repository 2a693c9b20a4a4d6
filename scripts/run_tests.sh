#!/usr/bin/env bash
# The whole suite as two pytest processes side by side (`make test`): the engines reached over
# HTTP or Ray (vllm serve servers, Ray clusters, the recipes run as their users do) and
# everything else. Their starts are chains of single-core imports (a server spawns its engine
# core, which spawns its workers), so on 2 cores each group leaves the other room.
# Each group prints its own summary and slowest tests (DURATIONS of them); the end says both.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
DURATIONS=${DURATIONS:-10}
# tests/mcore_vllm (torchrun recipes into in-process engines) runs with everything else: balance
REMOTE=(tests/serve/test_fsdp_recipe.py tests/serve/test_survives.py
        tests/serve/test_serve_failures.py tests/serve/test_tp_replicas.py
        tests/serve/test_verdict.py tests/ray tests/dtensor_vllm/test_ray_engine.py)
# Alone once both groups are done: a pause must meet a request in flight on the server, and
# with both groups loading the 2 cores its stream and metrics reached the client only after
# the request had ended (3 tries with doubling lengths, seen in 2 of 3 runs).
QUIET=(tests/serve/test_http_engine.py)
ignore=()
for path in "${REMOTE[@]}" "${QUIET[@]}"; do ignore+=(--ignore="$path"); done
log=$(mktemp -t refit-tests-remote.XXXXXX)
trap 'rm -f "$log"' EXIT
"$PY" -m pytest -q -ra --durations="$DURATIONS" -p no:cacheprovider "${REMOTE[@]}" > "$log" 2>&1 &
remote=$!
"$PY" -m pytest -q -ra --durations="$DURATIONS" "${ignore[@]}"
local_rc=$?
wait "$remote"
remote_rc=$?
echo "=== engines over HTTP and Ray (${REMOTE[*]}) ==="
cat "$log"
both=$SECONDS
echo "=== alone: ${QUIET[*]} ==="
"$PY" -m pytest -q -ra --durations="$DURATIONS" -p no:cacheprovider "${QUIET[@]}"
quiet_rc=$?
echo "=== make test: ${SECONDS} s wall (both groups ${both} s); rc $local_rc (everything" \
     "else), $remote_rc (engines over HTTP and Ray), $quiet_rc (alone) ==="
[ "$local_rc" -eq 0 ] && [ "$remote_rc" -eq 0 ] && [ "$quiet_rc" -eq 0 ]
