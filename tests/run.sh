#!/usr/bin/env bash
# The test command: makes .venv (torch 2.13.0 CPU first), installs the package with its test
# extra, lints (ruff, shellcheck, hadolint), checks that the built wheel installs and trains in a
# fresh venv, and runs the whole pytest suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[test]'
ruff check .
ruff format --check .
lint-imports --no-cache
if compgen -G "run_scripts/*.sh" >/dev/null; then shellcheck run_scripts/*.sh run_scripts/lib/*.sh run_scripts/slurm/*.sh run_scripts/k8s/*.sh tests/gpu/*.sh tests/run.sh tests/scripts/*.sh .ci/run; fi
if [ -f Dockerfile ]; then hadolint Dockerfile; fi
bash tests/scripts/wheel_check.sh python
python -m pytest -q -p no:cacheprovider "$@"
