#!/usr/bin/env bash
# The test command: makes .venv (torch 2.13.0 CPU first), installs the package with its test
# extra, lints (ruff, shellcheck, hadolint), checks that the built wheel installs and trains in a
# fresh venv, and runs the whole pytest suite on two workers.
#
# Budget: 20 minutes wall on an idle 2-core machine for all of it (docs/DESIGN.md section 12).
# Each step and the total are timed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
start=${SECONDS}
steps=()
step() { # step NAME CMD...: run CMD, record its wall time
  local name="$1" t0=${SECONDS}
  shift
  "$@"
  steps+=("$(printf '%-10s %5d s' "${name}" $((SECONDS - t0)))")
}
setup() {
  python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
  python -m pip install -q --upgrade pip
  python -m pip install -q torch==2.13.0
  python -m pip install -q -e '.[test]'
}
lint() {
  ruff check .
  ruff format --check .
  lint-imports --no-cache
  if compgen -G "run_scripts/*.sh" >/dev/null; then
    shellcheck run_scripts/*.sh run_scripts/lib/*.sh run_scripts/slurm/*.sh run_scripts/k8s/*.sh \
      tests/gpu/*.sh tests/run.sh tests/scripts/*.sh .ci/run
  fi
  if [ -f Dockerfile ]; then hadolint Dockerfile; fi
}
step setup setup
# shellcheck disable=SC1091
. .venv/bin/activate
step lint lint
step wheel bash tests/scripts/wheel_check.sh python
# Two workers, one intra-op thread each (and in every process they start): tiny graphs gain
# nothing from a second thread and two of them would oversubscribe the two cores.
# PRIMUS_TEST_WORKERS=0 runs the suite in this process (for a debugger).
step pytest env OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider \
  -n "${PRIMUS_TEST_WORKERS:-2}" --dist worksteal "$@"
printf 'test command wall time (budget 1200 s on 2 cores):\n'
printf '  %s\n' "${steps[@]}"
printf '  %-10s %5d s\n' total $((SECONDS - start))
