"""A V4.1 model out in its release layout: beside the release it came from, or on its own.

The writer (`release/save.py`: FP8 32 x 32 / FP4 / Engram FP8 rows as released, or bf16) takes
{release name: tensor}; this module gives it the model's weights through the name table
(`state_dict_adapter.to_release`) and the config.json of the published layout
(`config_json.release_config`). A model that came from a release is written beside it (its
non-text tensors carried over byte for byte, the unchanged blocks keeping their bytes); a
training run that came from none (a preset) is written on its own, every tensor the run's.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from primus_v4.checkpoint_formats.fp8_fp4 import FP8_1X32
from primus_v4.checkpoint_formats.sharded import WriteSummary
from primus_v4.errors import CheckpointFormatError
from primus_v4.models.deepseek_v41.release import state_dict_adapter as adapter
from primus_v4.models.deepseek_v41.release.config_json import release_config


def release_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """{release name: tensor} of every text-backbone weight of a whole model (logical,
    unquantized: [out, in], routed experts one tensor per expert and projection), the Engram
    tables placed frozen left out (`placed_frozen`)."""
    return adapter.to_release(model.cfg, model.state_dict())


def placed_frozen(model: nn.Module) -> list[str]:
    """The release names of the Engram tables `model` holds placed and frozen (their rows are
    the release's: an export carries them); a trainable table sharded over ranks is refused
    naming it (this process holds only its rows)."""
    from primus_v4.models.deepseek_v41.engram_placement import engram_modules, release_name

    out = []
    for name, engram in engram_modules(model):
        store = getattr(engram, "placed", None)
        if store is None:
            continue
        if store.weight is not None:  # trainable and placed: sharded
            raise CheckpointFormatError(
                f"{name}: this process holds the trained Engram table's rows [{store.lo}, "
                f"{store.hi}) of {store.rows} (model.engram.placement {store.placement}); "
                "export the run's checkpoint (`primus-v4 export`), which holds the whole table"
            )
        out.append(release_name(name))
    return out


def save_pretrained(
    model: nn.Module,
    out: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    source: str | os.PathLike | None = None,
    **options: Any,
) -> Any:
    """Write a whole model as a release directory at `out` (`dtype` "bfloat16" or "fp8": as
    released) beside `source` (default: the release the model was loaded from), which gives
    the tensors carried over (the Engram tables placed frozen: the model's own release)."""
    keep = placed_frozen(model)
    own = getattr(model, "release_source", None)
    src = source or own
    if src is None:
        raise CheckpointFormatError(
            "a DeepSeek-V4.1 model is saved beside the release it came from (its non-text "
            "tensors are carried over) and this one was loaded from none: call "
            "save_pretrained(model, out, source=<release directory>), or export the training "
            "run's checkpoint (`primus-v4 export`), which writes a run from a preset on its own"
        )
    _check_dtype(dtype)
    if keep and own is None:
        raise CheckpointFormatError(
            f"{', '.join(keep)}: placed frozen, the rows of a release this model does not "
            "record (not read by load_pretrained); export the run's checkpoint "
            "(`primus-v4 export`), which carries them from the run's model.pretrained"
        )
    if keep and Path(own).resolve() != Path(src).resolve():
        raise CheckpointFormatError(
            f"{', '.join(keep)}: placed frozen, so the rows are those of the release the model "
            f"was loaded from ({own}), not of {src}; save beside that release"
        )
    from primus_v4.models.deepseek_v41.release.save import save_release

    options.pop("progress", None)  # the release writer reports per tensor through a callback
    return save_release(release_state(model), Path(src), out, dtype=dtype, keep=keep,
                        config=functools.partial(release_config, model.cfg),
                        **options)  # fmt: skip


def _check_dtype(dtype: str) -> None:
    if dtype not in ("bfloat16", "fp8"):
        raise CheckpointFormatError(
            f"export dtype {dtype!r}: a DeepSeek-V4.1 release is written as 'bfloat16' or 'fp8'"
        )


def _held_as_rows(cfg: Any, section: Any, names: Iterable[str]) -> list[str]:
    """The release names of the Engram tables among `names` (ours) that a run (`section`: its
    `model` section) held frozen as FP8 rows, as `engram_placement.place_for_run` places
    them: frozen, rows a whole number of 32-value scale blocks wide."""
    if section is None or section.engram.trainable:
        return []
    table = adapter.name_table(cfg)
    rows = [table[n] for n in names if table[n].kind == "fp8row"]
    return [rel for e in rows if e.shape[-1] % FP8_1X32.block_cols == 0 for rel in e.release]


def write_state(
    cfg: Any,
    state: Iterable[dict[str, torch.Tensor]],
    out: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    source: str | os.PathLike | None = None,
    carry_from: str | os.PathLike | None = None,
    carried: Iterable[str] = (),
    section: Any = None,
    **options: Any,
) -> WriteSummary:
    """Write state-dict pieces (our names; together the whole model) as a release at `out`.

    Beside `source` (a training run's export passes the release it started from as
    `carry_from`): `carried` are our tensors not given, written as `source` stores them (the
    frozen Engram tables a run placed, which its checkpoint does not hold). With no release
    (a run from a preset) the pieces hold every tensor, `carried` ones included (drawn from the
    run's seed); those the run (`section`: its `model` section) held as FP8 rows are written
    as FP8 rows in either dtype."""
    source = source or carry_from
    _check_dtype(dtype)
    pieces = (adapter.to_release(cfg, piece) for piece in state)
    carried = list(carried)
    if source is None:
        from primus_v4.models.deepseek_v41.release.save import write_release

        config = release_config(cfg, drafter=cfg.dspark_train != "off")
        rows = _held_as_rows(cfg, section, carried)
        return write_release(pieces, out, config=config, dtype=dtype, rows=rows, **options)
    from primus_v4.models.deepseek_v41.release.save import save_release

    options.pop("extra_files", None)  # the writer copies the source's tokenizer files
    table = adapter.name_table(cfg)
    keep = [rel for name in carried for rel in table[name].release]
    config = functools.partial(release_config, cfg)
    return save_release(pieces, Path(source), out, dtype=dtype, keep=keep, config=config,
                        **options).summary  # fmt: skip
