"""Training checkpoint (DCP, any parallel layout) -> the release layout (bf16 or FP8 + FP4).

DCP stores each of our tensors once under `model.<name>` with its global shape (expert shards
are dim-0 DTensor shards of the global [E, ...] tensor; pipeline stages hold disjoint names), so
one process reads them back at any layout. The export streams: one layer's tensors are read at
a time, renamed and reshaped by the model family's name table (its release format's `names`),
quantized if asked and written into bounded shards (`write_state`), so memory stays about one
layer plus one shard. The checkpoint is verified first, as resume verifies it
(checkpoint.integrity.problems); its own model_config.json (or, saved without one, its own
config.yaml) gives the model config; the tokenizer files of the run travel along. A LoRA run's
adapters are merged into its base (lora.py), or written alone in PEFT's format
(`export_adapters`, peft.py). Tensors a run placed (`ModelSpec.place_tables`, DeepSeek-V4.1's
Engram tables) are read where its checkpoint holds them (a trainable table sharded over ranks:
as rows of the whole table under its placed name) or, frozen and kept out of the checkpoint,
carried from the run's release byte for byte (`ReleaseFormat.saved_as`); a run that started
from no release drew them from its seed, and the export draws them again (the whole model drawn
once from `train.seed`, as a random-init LoRA base is: small models only).

An export reads the release the run started from (`model.pretrained`: its tokenizer, the base a
LoRA run merges into, the tensors it carries, the layout a DeepSeek-V4.1 export is written
beside); a release that is gone is named, before anything is written, with the option that
points at another copy (`--release`, `with_release`). The tensors it carries byte for byte must
be the ones the run started from: their digests are taken again and compared with those the run
recorded when it started (`check_carried`; training/checkpoint/release_reads.py), and a release
changed since is refused the same way, naming the tensor.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from primus_v4.checkpoint_formats import sharded
from primus_v4.checkpoint_formats.sharded import (
    SCALE_SUFFIXES,
    ExportDtype,
    WriteSummary,
    load_workers,
    tokenizer_files,
)
from primus_v4.config import RunConfig, load_config
from primus_v4.config.resolve import (
    draft_overrides,
    model_config,
    tokenizer_of,
    vision_overrides,
)
from primus_v4.data.tokenizer import resolve_tokenizer_dir
from primus_v4.errors import (
    CheckpointError,
    CheckpointFormatError,
    ConfigError,
    UsageError,
    describe_os_error,
)
from primus_v4.export import peft
from primus_v4.export.lora import base_reader, is_adapter, load_group, merged_state
from primus_v4.export.peft import PeftSummary, write_peft
from primus_v4.log import get_logger
from primus_v4.models import release_spec, spec_of
from primus_v4.training.checkpoint import integrity, release_reads, safe_dcp
from primus_v4.training.checkpoint.lifecycle import CONFIG_FILE, MODEL_CONFIG_FILE
from primus_v4.training.checkpoint.store import check_layout, step_dir

log = get_logger(__name__)
MODEL_PREFIX = "model."


class ExportError(CheckpointError):
    """The training checkpoint cannot be exported (missing, damaged, or another model)."""


@dataclass(kw_only=True, frozen=True)
class ExportSource:
    """A verified training checkpoint and the run config stored in it."""

    checkpoint: Path
    run: RunConfig
    config_file: Path


def _present(root: Path) -> str:
    steps = sorted(d.name for d in root.glob("step_*")) if root.is_dir() else []
    return ", ".join(steps) or "none"


def _within(inner: Path, outer: Path) -> Path | None:
    """`inner` relative to `outer` when it lies inside it (both as recorded), else None."""
    a, b = Path(os.path.normpath(inner)), Path(os.path.normpath(outer))
    if a.is_absolute() != b.is_absolute() or a.parts[: len(b.parts)] != b.parts:
        return None
    return Path(*a.parts[len(b.parts) :])


def _launch_dir(run: Path, recorded_out: Path) -> Path | None:
    """Where a run that recorded a relative output.dir was started: `run` less that tail."""
    here = Path(os.path.normpath(run.absolute())).parts
    tail = Path(os.path.normpath(recorded_out)).parts
    if recorded_out.is_absolute() or not tail or here[-len(tail) :] != tail:
        return None
    return Path(*here[: -len(tail)])


def _checkpoint_root(p: Path) -> Path:
    """The checkpoint dir of `--run`: the dir itself when it holds step dirs, else the
    checkpoint.dir its config.yaml names, found from the run dir itself (not from where export
    runs): inside the run dir it follows the run (moved or copied), elsewhere it is the absolute
    path the run recorded, or for a run that recorded it relative, relative to where that run
    was started (its output.dir's tail)."""
    if any(p.glob("step_*")):
        return p
    config_file = p / CONFIG_FILE
    if not config_file.is_file():
        raise ExportError(
            f"{p}: holds no step_* checkpoints and no {CONFIG_FILE}; pass a run's output dir, "
            "its checkpoint.dir or one step_XXXXXXXX dir"
        )
    recorded = load_config(config_file)
    if not recorded.checkpoint.dir:
        raise ExportError(f"{config_file}: checkpoint.dir is unset, so the run saved nothing")
    ck, out = Path(recorded.checkpoint.dir), Path(recorded.output.dir)
    inside = _within(ck, out)
    if inside is not None:
        return p / inside
    if ck.is_absolute():
        return ck
    launch = _launch_dir(p, out)
    if launch is None:
        raise ExportError(
            f"{config_file}: checkpoint.dir {ck} is relative to where that run was started, "
            f"which its output.dir {out} does not tell from {p}; pass the checkpoint dir itself"
        )
    return launch / ck


def _verified(checkpoint: Path, *, verb: str) -> ExportSource:
    """`checkpoint` after the integrity check every reader makes, with its own config; a
    damaged one is refused in the words of what reads it (`verb`: "export", "evaluate")."""
    problems = integrity.problems(checkpoint, needs_config=True)
    if problems:
        raise ExportError(
            f"cannot {verb} {checkpoint}: {'; '.join(problems)}. {verb.capitalize()} another "
            f"step with --step (present: {_present(checkpoint.parent)})"
        )
    config_file = checkpoint / CONFIG_FILE
    return ExportSource(
        checkpoint=checkpoint, run=load_config(config_file), config_file=config_file
    )


def find_source(
    path: str | os.PathLike, step: int | None = None, *, verb: str = "export"
) -> ExportSource:
    """Resolve `--run` (a run output dir, a checkpoint dir, or one step's dir) and `--step` to a
    verified checkpoint: without --step the newest complete one, a named step or step dir, each
    read only when intact (a damaged newest one is refused by name, never replaced by an older
    one the user did not ask for). `verb` is what the command does with it, as its refusals
    say it ("cannot export ...", "cannot evaluate ...")."""
    p = Path(path)
    if not p.is_dir():
        raise ExportError(f"{p}: not a directory (pass a run's output dir or checkpoint dir)")
    if p.name.startswith("step_") or (p / ".metadata").is_file():  # one step's checkpoint
        if step is not None:
            raise ExportError(f"{p} is already one step's checkpoint; drop --step {step}")
        return _verified(p, verb=verb)
    root = _checkpoint_root(p)
    if step is not None:
        chosen = step_dir(root, step)
        if not chosen.is_dir():
            raise ExportError(f"{root}: no step {step} (present: {_present(root)})")
        return _verified(chosen, verb=verb)
    complete = integrity.complete_checkpoints(root)
    if not complete:
        raise ExportError(f"{root}: no complete checkpoint (present: {_present(root)})")
    return _verified(complete[-1], verb=verb)


def _missing_file(directory: Path) -> Path | None:
    """The first file of release `directory` that is not there (itself when it is gone): its
    config.json, its index or single shard, each shard its index names; None when all are."""
    if not directory.is_dir():
        return directory
    if not (directory / sharded.CONFIG_FILE).is_file():
        return directory / sharded.CONFIG_FILE
    index = directory / sharded.INDEX_FILE
    if not index.is_file():
        return None if (directory / sharded.SINGLE_FILE).is_file() else index
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # a damaged index: the reader names it
    return next((directory / s for s in shards if not (directory / s).is_file()), None)


def check_release(source: ExportSource) -> None:
    """The release `source`'s run started from (`model.pretrained`), which an export reads, is
    all there; else one line naming the missing file and `--release` (the commands' way to
    point at another copy). A run from no release passes."""
    pretrained = source.run.model.pretrained
    if not pretrained:
        return
    missing = _missing_file(Path(pretrained))
    if missing is not None:
        raise CheckpointFormatError(
            f"{missing}: not found; the export reads the release the run started from "
            f"(model.pretrained {pretrained}: its tokenizer, the tensors the run did not train), "
            "so name a copy of it with --release DIR; nothing was written"
        )


def with_release(source: ExportSource, release: str | os.PathLike | None) -> ExportSource:
    """`source` with its run's release read from `release` (`--release`: a copy of its
    `model.pretrained`, e.g. moved since the run; None: where the run recorded it); refused for
    a run that started from none."""
    model = source.run.model
    if release is None:
        return source
    if not model.pretrained:
        raise UsageError(
            f"--release {release}: {source.config_file} started from no release "
            "(model.pretrained is unset), so its export reads none; drop --release"
        )
    run = dataclasses.replace(source.run, model=dataclasses.replace(model, pretrained=str(release)))
    return dataclasses.replace(source, run=run)


def model_config_of(source: ExportSource) -> Any:
    """The model the checkpoint holds: its own release config (checksummed with it), or for a
    checkpoint saved without one the model its own config.yaml describes."""
    stored = source.checkpoint / MODEL_CONFIG_FILE
    if stored.is_file():
        release = release_spec(stored).release
        return release.config_from_json(json.loads(stored.read_text()), source=str(stored),
                                        **draft_overrides(source.run),
                                        **vision_overrides(source.run))  # fmt: skip
    return model_config(source.run)


def _stored_model_tensors(checkpoint: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Our tensor name -> (global shape, dtype) as the DCP metadata records them (after the
    checkpoint's model layout is checked to be this version's)."""
    check_layout(checkpoint)
    meta = safe_dcp.read_metadata(checkpoint).state_dict_metadata
    out = {}
    for key, m in meta.items():
        if key.startswith(MODEL_PREFIX) and hasattr(m, "size"):
            out[key[len(MODEL_PREFIX) :]] = (m.size, m.properties.dtype)
    return out


@dataclass(kw_only=True, frozen=True)
class Placed:
    """Tensors the run placed (`ModelSpec.place_tables`) that its checkpoint holds elsewhere."""

    renamed: dict[str, str]
    """our name -> the name the checkpoint stores it under (rows of the whole tensor)"""
    carried: list[str]
    """our names the checkpoint keeps out (frozen, as the release stores them): the export
    carries the release's bytes"""


def placed_tensors(cfg: Any, source: ExportSource, stored: dict) -> Placed:
    """Where the checkpoint holds the tensors its run placed; a frozen one is carried from the
    run's release, or drawn again from the run's seed when it started from a preset; a run
    that records neither is refused naming them (never written without them)."""
    saved_as = spec_of(cfg).release.saved_as
    renamed, carried = {}, []
    for ours, key in (saved_as(cfg, source.run.model) if saved_as else {}).items():
        if ours in stored:  # left in place: stored as itself
            continue
        if key is None:
            carried.append(ours)
        elif key in stored:
            renamed[ours] = key
    model = source.run.model
    if carried and not model.pretrained and not model.preset:
        raise ExportError(
            f"{source.checkpoint}: {', '.join(carried)}: frozen and kept as the release stores "
            "them, so in no training checkpoint, and the run records neither a model.pretrained "
            "release to carry them from nor a model.preset it drew them from; nothing was written"
        )
    return Placed(renamed=renamed, carried=carried)


def _carried_stored(cfg: Any, placed: Placed, reader: Any) -> list[str]:
    """The stored tensors (scales too) of the release `reader` opens that an export copies
    byte for byte: those of no tensor it writes (the model's name table less the ones the run
    kept out, `placed.carried`)."""
    table = spec_of(cfg).release.names.name_table(cfg)
    written = {rel for ours, e in table.items() if ours not in placed.carried for rel in e.release}
    logical = set(reader.names())

    def weight_of(stored: str) -> str:
        scale = next((s for s in SCALE_SUFFIXES if stored.endswith(s)), None)
        if stored in logical or scale is None:
            return stored
        return stored.removesuffix(scale) + ".weight"

    return [n for n in reader.stored_names() if weight_of(n) not in written]


def check_carried(source: ExportSource, cfg: Any, placed: Placed) -> None:
    """What an export of `source` copies from its run's release byte for byte (a vision tower,
    a drafter the run did not train, the tables it kept out) holds the bytes the run recorded
    when it started (the records its step carries, else its checkpoint.dir's, as a resume reads
    them); else one line naming the tensor and `--release`. A step with no record (saved by an
    older version) is exported with a warning."""
    release = source.run.model.pretrained
    if not release:
        return
    with spec_of(cfg).release.open(release) as reader:
        carried = _carried_stored(cfg, placed, reader)
        if not carried:
            return
        recorded = release_reads.records(source.checkpoint.parent, source.checkpoint)
        if not recorded:
            log.warning("%s: no record of the release its run started from (a checkpoint of an "
                        "older version); the %d tensors the export copies from model.pretrained="
                        "%s are copied unchecked", source.checkpoint, len(carried),
                        release)  # fmt: skip
            return
        found = release_reads.check_stored(reader, recorded, carried, workers=load_workers())
    changed = found.changed
    if changed is not None:
        span = changed.span
        raise ExportError(
            f"{release}: tensor '{changed.tensor}' (bytes {span['lo']}-{span['hi']} of "
            f"{span['shard']}) differs from the release the run started from ({changed.release}, "
            f"recorded in {changed.record}), and the export copies it byte for byte; name an "
            "unchanged copy of that release with --release DIR; nothing was written"
        )
    if found.unrecorded:
        log.warning("%s: %d of the %d tensors the export copies from %s have no digest in the "
                    "run's record (%s, ...; a record of an older version): copied unchecked",
                    source.checkpoint, len(found.unrecorded), len(carried), release,
                    found.unrecorded[0])  # fmt: skip
    log.info("%s: the %d tensors the export copies byte for byte match the release the run "
             "started from", release, found.compared)  # fmt: skip


def _check_names(cfg: Any, stored: dict, checkpoint: Path, placed: Placed) -> None:
    table = spec_of(cfg).release.names.name_table(cfg)
    back = {key: ours for ours, key in placed.renamed.items()}
    stored = {back.get(n, n): v for n, v in stored.items()}
    missing = [n for n in table if n not in stored and n not in placed.carried]
    unknown = [n for n in stored if n not in table]
    wrong = [
        f"{n} {list(stored[n][0])} (config: {list(table[n].shape)})"
        for n in table
        if n in stored and tuple(stored[n][0]) != tuple(table[n].shape)
    ]
    if missing or unknown or wrong:
        raise ExportError(
            f"{checkpoint}: does not hold the model of its config.yaml: missing {missing[:8]}, "
            f"unknown {unknown[:8]}, shape mismatches {wrong[:8]}"
        )


def _check_adapters(cfg: Any, stored: dict, checkpoint: Path) -> None:
    """A LoRA checkpoint holds adapters and the model's buffers, nothing else."""
    table = spec_of(cfg).release.names.name_table(cfg)
    stray = [n for n in stored if not is_adapter(n) and n not in table]
    if stray or not any(is_adapter(n) for n in stored):
        raise ExportError(
            f"{checkpoint}: not the adapters of a LoRA run of its config.yaml (model.lora): "
            f"unknown tensors {stray[:8]}"
            if stray
            else f"{checkpoint}: holds no adapter"
        )


def _groups(names: list[str]) -> list[list[str]]:
    """Tensors read together: one decoder layer or MTP depth at a time, the rest together."""
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] in ("layers", "mtp") else ""
        key = ".".join(parts[:3]) if parts[0] == "dspark" else key  # a draft stage
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _stored_state(
    checkpoint: Path, groups: list[list[str]], stored: dict, renamed: dict[str, str]
) -> Iterator[dict]:
    for group in groups:
        keys = {renamed.get(n, n): n for n in group}
        yield {keys[k]: t for k, t in load_group(checkpoint, list(keys), stored).items()}


def _drawn(cfg: Any, run: RunConfig, names: list[str]) -> Iterator[dict[str, torch.Tensor]]:
    """`names` as a run from no release drew them from its seed (float32; one piece)."""
    if names:
        with base_reader(cfg, run) as read:
            yield read(names)


def export_checkpoint(
    source: ExportSource,
    out: str | os.PathLike,
    *,
    dtype: ExportDtype = "bfloat16",
    max_shard_bytes: int = 5 * 2**30,
    progress: Callable[[int], None] | None = None,
) -> WriteSummary:
    """Write `source` as a release directory at `out` (atomic; see the module docstring)."""
    check_release(source)
    cfg = model_config_of(source)
    stored = _stored_model_tensors(source.checkpoint)
    placed = placed_tensors(cfg, source, stored)
    check_carried(source, cfg, placed)
    names = [n for n in spec_of(cfg).release.names.name_table(cfg) if n not in placed.carried]
    groups = _groups(names)
    if source.run.model.lora.rank:  # adapters + buffers: merged into the base as they stream
        _check_adapters(cfg, stored, source.checkpoint)
        pieces = merged_state(cfg, source.run, source.checkpoint, stored, groups)
    else:
        _check_names(cfg, stored, source.checkpoint, placed)
        pieces = _stored_state(source.checkpoint, groups, stored, placed.renamed)
    # the frozen tables (only families that place any): the release's stored bytes, copied, or
    # for a run from no release drawn again from its seed, as the run held them
    carried = {}
    if placed.carried:
        carried = {"carried": placed.carried, "section": source.run.model}
        if not source.run.model.pretrained:
            pieces = itertools.chain(pieces, _drawn(cfg, source.run, placed.carried))
    tokenizer_dir = resolve_tokenizer_dir(tokenizer_of(source.run))
    try:  # the writer removes its temp dir on any failure: nothing partial is left
        summary = spec_of(cfg).release.write_state(
            cfg,
            pieces,
            out,
            dtype=dtype,
            max_shard_bytes=max_shard_bytes,
            extra_files=tokenizer_files(tokenizer_dir),
            progress=progress,
            carry_from=source.run.model.pretrained,  # parts of the release not trained
            **carried,
        )
    except OSError as exc:
        error = describe_os_error(exc, "cannot write")
        raise type(error)(f"export of {source.checkpoint} to {out}: {error}; nothing was left "
                          "there") from exc  # fmt: skip
    log.info("exported %s -> %s (%s, %d shards)", source.checkpoint, out, dtype, summary.shards)
    return summary


QUANT_AWARE_CARD = """# LoRA adapters trained quantization-aware

These adapters were trained against the quantized merge (`train.quant_aware: release`): each
adapted weight was used as `Q(W + (lora_alpha / r) B A)`, the merged weight rounded to the
release's FP8 / FP4 blocks with its ue8m0 scales. The model that trained is the merged release
export (`primus-v4 export --format release --dtype fp8`). Applied unmerged over a base, these
adapters compute `W x + (lora_alpha / r) B A x`, which is not that model.
"""


def export_adapters(
    source: ExportSource, out: str | os.PathLike, *, dtype: torch.dtype | None = None
) -> PeftSummary:
    """Write the adapters of LoRA checkpoint `source` in PEFT's format at `out` (peft.py):
    one decoder layer read at a time, then the image encoder's adapters; the MTP blocks'
    adapters are counted, not written; the routers travel too when the run moved their bias."""
    lora = source.run.model.lora
    if not lora.rank:
        raise ConfigError(
            f"{source.config_file}: model.lora.rank is 0, so the run trained no adapters; "
            "--format peft exports a LoRA run's adapters (use --format release)"
        )
    check_release(source)
    cfg = model_config_of(source)
    stored = _stored_model_tensors(source.checkpoint)
    _check_adapters(cfg, stored, source.checkpoint)
    mtp = [n for n in stored if is_adapter(n) and n.startswith("mtp.")]
    routers = source.run.model.router_bias_update_rate > 0  # the run moved gate.bias
    # module names: the family's own (its release's, where transformers has no class for it),
    # else transformers' (peft.py)
    naming = spec_of(cfg).release.peft or peft
    vision = sorted(n for n in stored if is_adapter(n) and n.startswith(("vision.", "aligner.")))
    if vision and getattr(naming, "vision_tensors", None) is None:  # never a silent drop
        raise ExportError(
            f"{source.checkpoint}: holds adapters on an image encoder ({vision[0]}, ...) that "
            "this PEFT layout has no names for; nothing was written"
        )

    def wanted(name: str) -> bool:
        return is_adapter(name) or (routers and ".moe.router." in name)

    def layers() -> Iterator[tuple[int | None, dict[str, torch.Tensor]]]:
        with base_reader(cfg, source.run) if routers else nullcontext() as read:
            for group in _groups([n for n in stored if n.startswith("layers.") and wanted(n)]):
                index = int(group[0].split(".")[1])
                prefix = f"layers.{index}."
                own = load_group(source.checkpoint, group, stored)
                if read is not None:  # the router's weight is the base's (frozen)
                    own |= read([f"{prefix}moe.router.weight"])
                own = {n.removeprefix(prefix): t for n, t in own.items()}
                tensors = naming.block_tensors(
                    {n: t for n, t in own.items() if is_adapter(n)}, lora.targets,
                    cfg.num_moe_experts,
                )  # fmt: skip
                yield index, tensors | naming.router_tensors(own)
        if vision:  # the image encoder's adapters, outside the layers
            yield None, naming.vision_tensors(load_group(source.checkpoint, vision, stored))

    config = naming.adapter_config(lora, cfg, source.run.model.pretrained, routers)
    tokenizer = tokenizer_files(resolve_tokenizer_dir(tokenizer_of(source.run)))
    card = QUANT_AWARE_CARD if source.run.train.quant_aware == "release" else None
    try:
        summary = write_peft(out, layers(), config, dtype=dtype, extra_files=tokenizer,
                             left_out=len(mtp), prefix=naming.KEY_PREFIX, card=card)  # fmt: skip
    except OSError as exc:
        error = describe_os_error(exc, "cannot write")
        raise type(error)(f"export of {source.checkpoint} to {out}: {error}; nothing was left "
                          "there") from exc  # fmt: skip
    log.info("exported the adapters of %s -> %s (PEFT, %d tensors; %d MTP adapter tensors left "
             "out)", source.checkpoint, out, summary.tensors, summary.left_out)  # fmt: skip
    return summary


def release_tensor_count(source: ExportSource) -> int:
    """How many logical release tensors an export of `source` writes (the progress total; the
    tensors carried from the release are copied, not counted; drawn again, they are)."""
    cfg = model_config_of(source)
    names = spec_of(cfg).release.names
    placed = placed_tensors(cfg, source, _stored_model_tensors(source.checkpoint))
    copied = placed.carried if source.run.model.pretrained else []
    return len(names.release_tensors(cfg)) - sum(
        len(names.name_table(cfg)[n].release) for n in copied
    )
