#!/usr/bin/env bash
# CI's smoke test of vLLM 0.34's Model Runner V2 path (tests/integration/test_vllm_v2_ci_smoke.py, marker v2): builds
# vLLM 0.34's environment (.nox/vllm-0-34-0: its GPU wheel beside CPU torch, noxfile.py) through nox, reusing it
# when it already works, then runs the file there on vLLM's CPU platform with the CPU shims (ci/vllm_cpu_shims.py).
# Prints each phase's wall time. Needs .venv (bash ci/setup.sh: nox comes with the dev extra).
# This script builds the environment the v2 tests need, so nothing collected, or any of them skipped, fails it.
set -uo pipefail
cd "$(dirname "$0")/.."
ENV_DIR=.nox/vllm-0-34-0
SESSION="vllm(0.34.0)"
TESTS=tests/integration/test_vllm_v2_ci_smoke.py
PY="$ENV_DIR/bin/python"

fail() {
  echo "ci/v2_smoke.sh: $1" >&2
  exit 1
}
now() { date +%s.%N; }
seconds() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
# the environment works: vLLM 0.34.0 installed, ringkv from this checkout
env_works() {
  [ -x "$PY" ] && "$PY" - "$PWD" <<'EOF' >/dev/null 2>&1
import importlib.metadata, pathlib, sys
import ringkv.kernels
assert importlib.metadata.version("vllm") == "0.34.0"
assert pathlib.Path(ringkv.kernels.__file__).resolve().parent.parent == pathlib.Path(sys.argv[1]).resolve()
EOF
}

[ -x .venv/bin/nox ] || fail ".venv/bin/nox is missing: run bash ci/setup.sh first (it installs nox with the dev extra)"

# phase 1: the environment (nox -R skips the installs where the environment exists and works)
start=$(now)
if env_works; then
  .venv/bin/nox -R -s "$SESSION" --install-only || fail "nox -R -s '$SESSION' --install-only failed on $ENV_DIR"
else
  echo "ci/v2_smoke.sh: building vLLM 0.34's environment ($ENV_DIR) with nox"
  .venv/bin/nox -s "$SESSION" --install-only || fail "could not build vLLM 0.34's environment ($ENV_DIR) with
  .venv/bin/nox -s '$SESSION' --install-only (output above). Fix: a machine that reaches PyPI (or pip's configured
  index; noxfile.py hands uv pip's indexes and ci/constraints-cpu.txt), then rebuild it from scratch:
  rm -rf $ENV_DIR && .venv/bin/nox -s '$SESSION' --install-only"
  env_works || fail "$ENV_DIR does not import vLLM 0.34.0 and this checkout's ringkv after the build. Fix: rebuild
  it from scratch: rm -rf $ENV_DIR && .venv/bin/nox -s '$SESSION' --install-only"
fi
build_s=$(seconds "$start" "$(now)")
echo "ci/v2_smoke.sh phase: V2 env build ${build_s} s"

# phase 2: the smoke test. RINGKV_REQUIRE's groups (vllm, interpreter, compile) are the main suite's: this run has
# none of their tests, so the variable is left out; that no v2 test skips is checked here, from pytest's report
report=$(mktemp -d)
start=$(now)
env -u RINGKV_REQUIRE VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 PYTHONPATH="ci${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -m pytest -p vllm_cpu_shims -n 0 -m v2 -rs --junitxml="$report/v2.xml" "$TESTS"
status=$?
smoke_s=$(seconds "$start" "$(now)")
echo "ci/v2_smoke.sh phase: V2 smoke ${smoke_s} s"
if [ "$status" -eq 5 ]; then
  echo "ci/v2_smoke.sh: pytest collected no v2 test from $TESTS: failing the run" >&2
  exit 1
fi
if [ "$status" -eq 0 ]; then
  "$PY" - "$report/v2.xml" <<'EOF' || exit 1
import sys
import xml.etree.ElementTree as ET

cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
skipped = [case for case in cases if case.find("skipped") is not None]
for case in skipped:
    print(f"  {case.get('name')}: {case.find('skipped').get('message')}", file=sys.stderr)
if skipped or not cases:
    print(f"ci/v2_smoke.sh: {len(skipped)} of {len(cases)} v2 tests skipped (none may). Fix: "
          "run them in vLLM 0.34's environment as this script does (VLLM_TARGET_DEVICE=cpu, PYTHONPATH=ci, "
          "-p vllm_cpu_shims); rebuild it with rm -rf .nox/vllm-0-34-0 && bash ci/v2_smoke.sh", file=sys.stderr)
    sys.exit(1)
EOF
fi
exit "$status"
