"""Parallel sizes validation and the pipeline layout parser (Flash / Pro strings)."""

from __future__ import annotations

import pytest

from primus_v4.errors import ConfigError
from primus_v4.parallel.groups import ParallelContext, ParallelDims
from primus_v4.parallel.pipeline_layout import even_pp_layout, parse_pp_layout, plan_stages

FLASH = "Et*14|t*14|t*15mL"


def test_dims_derive_dp_and_expert_dp() -> None:
    d = ParallelDims(world=24, pp=3, ep=8)  # Flash at 4k: TP1 PP3 CP1 EP8 on 24 ranks
    assert (d.dp, d.expert_dp) == (8, 1)
    d = ParallelDims(world=64, pp=1, cp=8, ep=8)
    assert (d.dp, d.expert_dp) == (8, 8)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"world": 4, "tp": 2}, "tensor parallelism is deliberately absent"),
        ({"world": 4, "etp": 2}, "tensor parallelism is deliberately absent"),
        (
            {"world": 6, "pp": 4},
            r"world size 6 is not divisible by parallel.pp x parallel.cp = 4 x 1 = 4",
        ),
        ({"world": 4, "pp": 2, "ep": 4}, r"ep=4 must divide dp x cp = 2 x 1 = 2"),
        ({"world": 0}, "parallel.world must be a positive integer"),
    ],
)
def test_dims_errors_name_the_numbers(sizes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ParallelDims(**sizes)


def test_model_checks() -> None:
    d = ParallelDims(world=24, pp=3, ep=8)
    d.check_model(num_layers=43, num_experts=256, pp_layout=FLASH, mtp_num_layers=1)
    with pytest.raises(
        ConfigError, match=r"parallel\.ep=8 must divide the model's num_moe_experts=250"
    ):
        d.check_model(num_layers=43, num_experts=250, mtp_num_layers=1)
    with pytest.raises(ConfigError, match=r"places 43 decoder layers .* num_layers=42"):
        d.check_model(num_layers=42, num_experts=256, pp_layout=FLASH, mtp_num_layers=1)


def test_flash_layout() -> None:
    stages = parse_pp_layout(FLASH, pp=3, num_layers=43, mtp_num_layers=1)
    assert [s.symbols for s in stages] == ["E" + "t" * 14, "t" * 14, "t" * 15 + "mL"]
    assert stages[1].decoder_layers == tuple(range(14, 28))
    assert stages[2].decoder_layers[-1] == 42 and stages[2].mtp_depths == (0,)
    assert stages[0].has_embedding and stages[2].has_loss and not stages[1].has_loss
    # The default even split of 43 layers over 3 stages is Flash's published layout.
    assert even_pp_layout(pp=3, num_layers=43, mtp_num_layers=1) == "Et*14|t*14|t*15mL"


def test_pro_style_layouts() -> None:
    # 61 layers on 16 stages with megatron's group repeat; commas are cosmetic.
    stages = parse_pp_layout("Et*3|(t*4|)*14,t*2mL", pp=16, num_layers=61, mtp_num_layers=1)
    assert [len(s.decoder_layers) for s in stages] == [3] + [4] * 14 + [2]
    assert stages[-1].symbols == "ttmL"
    stages = plan_stages(pp=8, num_layers=61, mtp_num_layers=1)
    assert [len(s.decoder_layers) for s in stages] == [7, 7, 7, 8, 8, 8, 8, 8]
    assert plan_stages(pp=1, num_layers=3)[0].symbols == "EtttL"


def test_the_even_split_is_its_layout_parsed() -> None:
    """Without a layout the even split's stages are written out (no parser, no megatron-core):
    the same stages as its layout string parsed, the same errors."""
    for pp in range(1, 6):
        for num_layers in range(pp, 10):
            for mtp in (0, 1, 2):
                sizes = {"pp": pp, "num_layers": num_layers, "mtp_num_layers": mtp}
                layout = even_pp_layout(**sizes)
                assert plan_stages(**sizes) == parse_pp_layout(layout, **sizes), layout
    with pytest.raises(ConfigError, match=r"num_layers=2 is fewer than pipeline stages pp=3"):
        plan_stages(pp=3, num_layers=2)


@pytest.mark.parametrize(
    ("layout", "pp", "message"),
    [
        ("Et*14|t*14|t*15mL", 2, "has 3 stages but parallel.pp is 2"),
        ("Et*14|t*14|t*14mL", 3, "places 42 decoder layers"),
        ("Et*14|t*14|t*15L", 3, "places 0 MTP depths .* mtp_num_layers=1"),
        ("Et*14|t*14m|t*15L", 3, "MTP depths .* must follow every decoder layer"),
        ("t*14|Et*14|t*15mL", 3, "E .* first in stage 0"),
        ("Et*14|t*14|t*15mLx", 3, r"unknown characters \['x'\]"),
        ("Et*14||t*29mL", 3, "stage 1 '' holds no decoder"),
    ],
)
def test_layout_errors(layout: str, pp: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_pp_layout(layout, pp=pp, num_layers=43, mtp_num_layers=1)


def test_single_process_context() -> None:
    ctx = ParallelContext.single()
    assert ctx.cp.size == 1 and ctx.cp_group is None and ctx.is_first_stage and ctx.is_last_stage
    # init_parallel on one real rank runs in tests/distributed: gloo started in the pytest
    # process would be inherited by the workers the harness forks later.
