#!/usr/bin/env bash
# The wheel works like the checkout: build it, install it into a fresh venv (torch first, as a
# user would), and from outside the repository show a shipped preset and train 2 steps with the
# shipped default config. Called by tests/run.sh; usage: bash tests/scripts/wheel_check.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/../.."
repo="$(pwd)"
python="${1:-python3}"
work="$(mktemp -d "${TMPDIR:-/tmp}/primus_v4-wheel.XXXXXX")"
trap 'rm -rf "${work}"' EXIT

"${python}" -m pip wheel -q --no-deps --wheel-dir "${work}/dist" "${repo}"
wheel="$(ls "${work}"/dist/primus_v4-*.whl)"
# The presets, run configs and the native quantizer's source must be inside the wheel.
"${python}" - "${wheel}" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["primus_v4/configs/models/deepseek_v4_flash.yaml", "primus_v4/configs/runs/tiny_cpu_thd.yaml",
        "primus_v4/checkpoint_formats/quant_bf16.c"]
missing = [n for n in need if n not in names]
sys.exit(f"wheel lacks {missing}" if missing else 0)
PY
"${python}" -m venv "${work}/venv"
"${work}/venv/bin/python" -m pip install -q torch==2.13.0
"${work}/venv/bin/python" -m pip install -q "${wheel}"

cd "${work}"  # nothing from the checkout is importable from here
"${work}/venv/bin/primus-v4" inspect model deepseek_v4_flash
"${work}/venv/bin/primus-v4" train \
  --set train.steps=2 --set train.warmup_steps=1 --set data.seq_length=512 \
  --set output.dir="${work}/out" --set data.cache_dir="${work}/packs" \
  --set data.lock_dir="${work}/locks" --set output.progress_bar=false --set output.plot=false
test "$(wc -l < "${work}/out/metrics.jsonl")" -eq 2
# where a C compiler is at hand, the installed package builds its native quantizer
if command -v "${CC:-cc}" >/dev/null; then
  PRIMUS_V4_CACHE_DIR="${work}/cache" "${work}/venv/bin/python" -c \
    "from primus_v4.checkpoint_formats import native_quant as n; assert n.library(), 'no build'"
fi
echo "wheel check: ok ($(basename "${wheel}"))"
