"""primus_v4/mcore.py: megatron-core imported without its import-time torch.compile and wandb
probe, and both patches undone once the import returns."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import json, sys, torch
real = torch.compile
from primus_v4.mcore import megatron_import
with megatron_import():
    import megatron.core.transformer
    hidden = sys.modules.get("wandb", 0) is None
    patched = torch.compile is not real
print(json.dumps({
    "restored": torch.compile is real,
    "patched_during": patched,
    "wandb_hidden_during": hidden,
    "wandb_entry_after": "wandb" in sys.modules,
    "dynamo_loaded": "torch._dynamo" in sys.modules and "torch._inductor" in sys.modules,
}))
"""


def test_the_import_is_patched_only_while_it_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=600
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["patched_during"] and seen["wandb_hidden_during"], seen
    assert seen["restored"] and not seen["wandb_entry_after"], seen
    assert not seen["dynamo_loaded"], "megatron-core's jit helpers compiled at import"


def test_a_deferred_compile_compiles_on_first_call() -> None:
    from primus_v4.mcore import _compile_on_first_call

    calls: list[dict] = []

    def fake_compile(fn, **options):
        calls.append(options)
        return lambda *a: fn(*a) + 1

    deferred = _compile_on_first_call(fake_compile)

    @deferred(mode="max-autotune")
    def double(x: int) -> int:
        return 2 * x

    assert calls == [] and double.__name__ == "double"
    assert double(3) == 7 and double(4) == 9
    assert calls == [{"mode": "max-autotune"}]
