"""What a run trains, part by part, as its config says: a resume keeps every part its checkpoint
trained and trains none the checkpoint does not hold.

A checkpoint holds the parts its run trained (with their optimizer state), and nothing of what
stayed as released: that comes from model.pretrained again on resume. So the training switches
decide what a checkpoint holds:

- the language model's weights: `model.lora.rank=0` and `model.draft.train` not `only`;
- the LoRA adapters (their rank, targets and expert sharing): `model.lora.rank > 0`;
- the Engram tables: `model.engram.trainable=true`;
- the DSpark drafter: `model.draft.train` `joint` or `only`;
- the image encoder's aligner (and its span vectors): `model.vision.train` `aligner` or `all`;
- the image encoder's tower: `model.vision.train=all`.

A resume whose switches would leave out a part the checkpoint trained (a narrower mode: the
drafter's `joint -> off`, the encoder's `all -> frozen`, ...) would train on from the release's
values of that part and export those: it is refused before any work, naming the part and the
switch. A resume that would train a part the checkpoint does not hold (a wider mode) has no
weights or optimizer state for it: refused alike. Both say the way on: resume with the
checkpoint's switches, or export the run and start a new run from its export. Reads only the
two configs (no torch), so `train --dry-run` makes the same check.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from primus_v4.errors import ResumeError


@dataclass(frozen=True, kw_only=True)
class Part:
    """One trained part: its name, what identifies its tensors (a change is another part), and
    the switches that decide it."""

    name: str
    identity: Any
    switches: tuple[str, ...]


def _section(model: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = model.get(key)
    return value if isinstance(value, Mapping) else {}


def trained_parts(model: Mapping[str, Any]) -> dict[str, Part]:
    """The parts a run's `model` section (as its config.yaml holds it) trains, by name. A
    missing switch has its default (a checkpoint of a version without it)."""
    lora = _section(model, "lora")
    rank = int(lora.get("rank") or 0)
    draft = _section(model, "draft").get("train", "off")
    vision = _section(model, "vision").get("train", "frozen")
    parts = []
    if rank == 0 and draft != "only":
        parts.append(Part(name="the language model's weights", identity=None,
                          switches=("model.lora.rank", "model.draft.train")))  # fmt: skip
    if rank > 0:
        targets = tuple(sorted(lora.get("targets") or ()))
        identity = (rank, targets, lora.get("expert_adapters", "per_expert"))
        parts.append(Part(name="the LoRA adapters", identity=identity,
                          switches=("model.lora.rank", "model.lora.targets",
                                    "model.lora.expert_adapters")))  # fmt: skip
    if _section(model, "engram").get("trainable", False):
        parts.append(Part(name="the Engram tables", identity=None,
                          switches=("model.engram.trainable",)))  # fmt: skip
    if draft in ("joint", "only"):
        parts.append(Part(name="the DSpark drafter", identity=None,
                          switches=("model.draft.train",)))  # fmt: skip
    if vision in ("aligner", "all"):
        parts.append(Part(name="the image encoder's aligner", identity=None,
                          switches=("model.vision.train",)))  # fmt: skip
    if vision == "all":
        parts.append(Part(name="the image encoder's tower", identity=None,
                          switches=("model.vision.train",)))  # fmt: skip
    return {part.name: part for part in parts}


def _value(model: Mapping[str, Any], dotted: str) -> Any:
    section, key = dotted.removeprefix("model.").split(".")
    return _section(model, section).get(key)


def _switches(parts: list[Part], saved: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    """`key: saved -> current` for each switch of `parts` that changed."""
    keys = dict.fromkeys(k for part in parts for k in part.switches)
    shown = []
    for key in keys:
        old, new = _value(saved, key), _value(current, key)
        if old != new:
            shown.append(f"{key}: {old!r} -> {new!r}")
    return ", ".join(shown)


def _names(parts: list[Part]) -> str:
    return ", ".join(part.name for part in parts)


def check_trained_parts(where: str, saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Raise ResumeError when this run (its `model` section `current`) would drop a part the
    checkpoint at `where` trained (`saved`, its config.yaml's `model` section), or train one the
    checkpoint does not hold (module docstring)."""
    before, after = trained_parts(saved), trained_parts(current)
    dropped = [p for name, p in before.items() if name not in after]
    added = [p for name, p in after.items() if name not in before]
    changed = [p for name, p in after.items() if name in before and before[name] != p]
    if not dropped and not added and not changed:
        return
    what = []
    if dropped:
        what.append(f"it trained {_names(dropped)}, which this run would leave as released "
                    "(the trained values dropped)")  # fmt: skip
    if added:
        what.append(f"this run would train {_names(added)}, which it does not hold (no "
                    "trained values or optimizer state to continue)")  # fmt: skip
    if changed:
        what.append(f"{_names(changed)} it trained are not this run's (other tensors)")
    switches = _switches(dropped + added + changed, saved, current)
    raise ResumeError(
        f"cannot resume from {where}: {'; '.join(what)} ({switches}). A resume continues what "
        "the checkpoint trained: resume with its settings, or export the run (primus-v4 export "
        "--run <output.dir>) and start a new run from the export (model.pretrained=<export>) in "
        "another checkpoint.dir"
    )


def check_newest(cfg: Any) -> None:
    """The check above against the newest complete checkpoint a resuming run would continue, from
    its config.yaml alone (no hashing, no torch): the run and its dry run refuse a mode change
    before packing. An unreadable config is left to the resume's integrity check."""
    import yaml

    from primus_v4.config import to_dict
    from primus_v4.training.checkpoint.integrity import CONFIG_FILE, complete_checkpoints

    ck = cfg.checkpoint
    if ck.dir is None or not ck.resume:
        return
    saved = complete_checkpoints(Path(ck.dir))
    if not saved:
        return
    try:
        body = yaml.safe_load((saved[-1] / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return
    if isinstance(body, dict) and isinstance(body.get("model"), dict):
        check_trained_parts(str(saved[-1]), body["model"], to_dict(cfg)["model"])
