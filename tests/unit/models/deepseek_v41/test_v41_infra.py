"""V4.1's parallel machinery without processes: the CP boundary rows, the config gate they set,
and what a pipeline stage boundary carries for every cut of the tiny preset."""

from __future__ import annotations

import pytest
import torch
from train_fakes import tiny_run

from primus_v4.errors import ConfigError
from primus_v4.models import model_spec
from primus_v4.models.deepseek_v41.infra.cp_batch import required_local_rows
from primus_v4.models.deepseek_v41.infra.pipeline_stage import build_stage
from primus_v4.parallel.pipeline_layout import plan_stages

SPEC = model_spec("deepseek_v41")


def test_cp_boundary_rows_cover_the_window_the_groups_and_the_engram_look_back() -> None:
    tiny = SPEC.config_class.preset("tiny_v41")
    assert required_local_rows(tiny) == tiny.attn_sliding_window - 1 == 63
    # A short window: the Engram look-back (max n-gram 4 -> 3 rows) is the widest boundary.
    short = SPEC.config_class.preset("tiny_v41", attn_sliding_window=2, engram_max_ngram_size=4)
    assert required_local_rows(short) == 3
    assert SPEC.cp_min_rows(tiny) == 63


def test_too_many_cp_ranks_for_the_window_is_one_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"leaves 32 rows per rank, fewer than the 63"):
        tiny_run(tmp_path, "model.preset=tiny_v41", "data.seq_length=128", "parallel.cp=4",
                 world=4)  # fmt: skip


@pytest.mark.parametrize(
    "cut,live",
    [
        # (first layer of stage 1) -> (kv source, index source, candidates) it receives
        (1, (None, None, False)),  # only the window layer 0 before: nothing shared yet
        (2, (1, 1, False)),  # layer 1's ratio-2 pool and selection
        (4, (3, 3, True)),  # layer 3's ratio-1 pool, selection and candidate blocks
        (5, (3, 3, True)),
    ],
)
def test_a_stage_boundary_carries_the_latest_sources(cut: int, live: tuple) -> None:
    cfg = SPEC.config_class.preset("tiny_v41", vocab_size=512)
    with torch.device("meta"):
        full = SPEC.build(cfg)
    layout = f"Et*{cut}|t*{cfg.num_layers - cut}L"
    first, second = (build_stage(full, s) for s in plan_stages(pp=2, num_layers=6, layout=layout))
    assert second._live(second.spec.decoder_layers[0]) == live
    # Engram layers 1 and 4: a stage hashes token ids only when it holds one
    assert (first.engram_rows is not None, second.engram_rows is not None) == (cut > 1, cut <= 4)
    x, pre, pool, index = second.boundary(10)
    assert x.shape == (10, cfg.hc_mult, cfg.hidden_size) and pre.dtype == torch.float32
    # pool: one position per row at most (ratio 1), KV beside the index keys
    assert pool.shape == (10, cfg.kv_channels + cfg.index_head_dim)
    assert index.shape == (10, cfg.index_topk + cfg.candidate_topk_blocks)
    assert index.dtype == torch.int64 and not index.requires_grad and pool.requires_grad
