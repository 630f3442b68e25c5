"""Pipeline stages from a Megatron-style layout string.

Layout grammar (megatron-core's `pipeline_model_parallel_layout`): `E` embedding, `t` one decoder
layer, `m` one MTP depth, `L` loss (LM head + cross-entropy), `|` stage boundary, `x*N` repeats
one symbol, `(...)*N` repeats a group, commas are cosmetic. Flash on 3 stages:
`Et*14|t*14|t*15mL` (43 decoder layers: 14 + 14 + 15, MTP and loss on the last stage).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from primus_v4.errors import ConfigError
from primus_v4.mcore import megatron_import

_SYMBOLS = "EtmL"
_ALLOWED = set(_SYMBOLS + "|*(),0123456789 ")


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """What one pipeline stage builds.

    index: stage number (0 = first).
    has_embedding / has_loss: holds the token embedding / LM head + loss.
    decoder_layers: global indices of the decoder layers of this stage, in order.
    mtp_depths: indices of the MTP depths built here (they need the last decoder layer's output,
        so they sit after every decoder layer).
    """

    index: int
    has_embedding: bool
    decoder_layers: tuple[int, ...]
    mtp_depths: tuple[int, ...]
    has_loss: bool

    @property
    def symbols(self) -> str:
        return (
            "E" * self.has_embedding
            + "t" * len(self.decoder_layers)
            + "m" * len(self.mtp_depths)
            + "L" * self.has_loss
        )


def _expand(layout: str) -> list[str]:
    """The per-stage symbol strings of `layout` (megatron's parser, with ConfigError messages)."""
    bad = sorted(set(layout) - _ALLOWED)
    if bad:
        raise ConfigError(
            f"pp_layout {layout!r}: unknown characters {bad}; use E (embedding), t (decoder "
            "layer), m (MTP depth), L (loss), | (stage boundary), x*N and (...)*N repeats"
        )
    if layout.count("(") != layout.count(")"):
        raise ConfigError(f"pp_layout {layout!r}: unbalanced parentheses")
    with megatron_import():
        from megatron.core.transformer.pipeline_parallel_layer_layout import (
            PipelineParallelLayerLayout,
        )
    try:
        stages = PipelineParallelLayerLayout.parse_str_to_list(layout.replace(" ", ""))
    except (AssertionError, KeyError) as err:
        raise ConfigError(f"pp_layout {layout!r} does not parse: {err}") from None
    names = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
    return ["".join(names[t.name] for t in stage) for stage in stages]


def parse_pp_layout(
    layout: str, *, pp: int, num_layers: int, mtp_num_layers: int = 0
) -> list[StageSpec]:
    """Parse and validate `layout` against the model; one `StageSpec` per stage."""
    return _stage_specs(
        _expand(layout), layout=layout, pp=pp, num_layers=num_layers, mtp_num_layers=mtp_num_layers
    )


def _stage_specs(
    stages: list[str], *, layout: str, pp: int, num_layers: int, mtp_num_layers: int
) -> list[StageSpec]:
    """`layout`'s per-stage symbol strings validated against the model, as `StageSpec`s."""
    where = f"pp_layout {layout!r}"
    if len(stages) != pp:
        raise ConfigError(
            f"{where} has {len(stages)} stages but parallel.pp is {pp} (virtual pipeline "
            "stages are not supported: one stage per pipeline rank)"
        )
    flat = "".join(stages)
    counts = {s: flat.count(s) for s in _SYMBOLS}
    if counts["E"] != 1 or not stages[0].startswith("E"):
        raise ConfigError(f"{where}: E (embedding) must appear exactly once, first in stage 0")
    if counts["L"] != 1 or not stages[-1].endswith("L"):
        raise ConfigError(f"{where}: L (loss) must appear exactly once, last in the last stage")
    if counts["t"] != num_layers:
        raise ConfigError(
            f"{where} places {counts['t']} decoder layers (t) but the model has "
            f"num_layers={num_layers}"
        )
    if counts["m"] != mtp_num_layers:
        raise ConfigError(
            f"{where} places {counts['m']} MTP depths (m) but the model has "
            f"mtp_num_layers={mtp_num_layers}"
        )
    if counts["m"] and (flat.rindex("t") > flat.index("m") or stages[-1].count("m") != counts["m"]):
        # MTP consumes the last decoder layer's hidden state and shares the LM head.
        raise ConfigError(
            f"{where}: MTP depths (m) must follow every decoder layer, on the last stage beside L"
        )
    for i, stage in enumerate(stages):
        if not re.fullmatch(r"E?t*m*L?", stage):
            raise ConfigError(f"{where}: stage {i} {stage!r} is out of order (want E t.. m.. L)")
        if "t" not in stage and "m" not in stage:
            raise ConfigError(f"{where}: stage {i} {stage!r} holds no decoder or MTP layer")
    specs, layer, depth = [], 0, 0
    for i, stage in enumerate(stages):
        n_t, n_m = stage.count("t"), stage.count("m")
        specs.append(
            StageSpec(
                index=i,
                has_embedding="E" in stage,
                decoder_layers=tuple(range(layer, layer + n_t)),
                mtp_depths=tuple(range(depth, depth + n_m)),
                has_loss="L" in stage,
            )
        )
        layer, depth = layer + n_t, depth + n_m
    return specs


def even_pp_layout(*, pp: int, num_layers: int, mtp_num_layers: int = 0) -> str:
    """Default split: layers as even as possible, the remainder on the last stages.

    The first stage carries the embedding, so extra layers go to the later stages (43 layers on
    3 stages give 14 + 14 + 15, Flash's published layout).
    """
    return "|".join(_even_stages(pp=pp, num_layers=num_layers, mtp_num_layers=mtp_num_layers))


def _even_stages(
    *, pp: int, num_layers: int, mtp_num_layers: int, repeat: bool = True
) -> list[str]:
    """The even split's per-stage symbols: `t*14` (`repeat`) or the 14 `t`s written out."""
    if num_layers < pp:
        raise ConfigError(
            f"num_layers={num_layers} is fewer than pipeline stages pp={pp}; "
            "every stage needs at least one decoder layer"
        )
    base, extra = divmod(num_layers, pp)
    counts = [base + (1 if i >= pp - extra else 0) for i in range(pp)]
    stages = [f"t*{n}" if repeat else "t" * n for n in counts]
    stages[0] = "E" + stages[0]
    stages[-1] += "m" * mtp_num_layers + "L"
    return stages


def plan_stages(
    *, pp: int, num_layers: int, mtp_num_layers: int = 0, layout: str | None = None
) -> list[StageSpec]:
    """Stages from `layout`, or the default even split when it is None/empty (written out
    here: no layout parser, so no megatron-core import)."""
    sizes = {"pp": pp, "num_layers": num_layers, "mtp_num_layers": mtp_num_layers}
    if layout:
        return parse_pp_layout(layout, **sizes)
    stages = _even_stages(**sizes, repeat=False)
    return _stage_specs(stages, layout=even_pp_layout(**sizes), **sizes)
