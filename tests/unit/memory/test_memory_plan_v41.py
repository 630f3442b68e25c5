"""The memory plan of DeepSeek-V4.1: per layer role, the saved bytes counted from the code equal
a saved-tensor measurement of the tiny model; Engram tables counted where `model.engram` puts
them (FP8 + e8m0 replicated, sharded over a stage's ranks, in host memory; trainable rows with
optimizer state for the rows a rank holds); the shared caches a later stage receives."""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from primus_v4.config import load_config, resolve_run
from primus_v4.memory.plan import plan_memory, saved_parts
from primus_v4.memory.saved_bytes import SavedBytes
from primus_v4.models.deepseek_v41.config import DeepseekV41Config
from primus_v4.models.deepseek_v41.indexer import SCORE_ELEMS
from primus_v4.models.deepseek_v41.memory_terms import layer_role as v41_role
from primus_v4.models.deepseek_v41.model import DeepseekV41Model

TABLES = (4062, 4152)  # tiny_v41's Engram rows
WIDTH = 16


class _Roles:
    def __init__(self, cfg: DeepseekV41Config) -> None:
        self.num_layers = cfg.num_layers
        self.layer_kind = lambda i: v41_role(cfg, i)


def test_the_plan_counts_what_each_v41_layer_saves() -> None:
    """bf16, one sample filling a 256-row pack: every role of the tiny model (window, a ratio-2
    source with Engram and its reuse, a ratio-1 source picking candidates, a reuse with Engram,
    a reindex layer) within 5% (the plan rounds a few small float32 per-row tensors)."""
    cfg = DeepseekV41Config.preset("tiny_v41", vocab_size=512)
    torch.manual_seed(0)
    model = DeepseekV41Model(cfg).to(torch.bfloat16)
    seq, ids = 256, torch.randint(1, 512, (1, 256))
    cu = torch.tensor([0, seq], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=seq, max_seqlen_kv=seq)  # fmt: skip
    with SavedBytes(model, _Roles(cfg)) as saved:
        model(ids, packed_seq_params=psp, labels=ids, loss_mask=torch.ones(1, seq))
    measured = saved.by_kind()
    roles = [v41_role(cfg, i) for i in range(cfg.num_layers)]
    assert roles == ["window", "ratio2 source +engram", "ratio2 reuse", "ratio1 source +cand",
                     "ratio1 reuse +engram", "ratio1 reindex"]  # fmt: skip
    for layer, role in enumerate(roles):
        planned = sum(saved_parts(cfg, layer, rows=seq, seq=seq, b=2).values())
        assert planned == pytest.approx(measured[role], rel=0.05), role


def _plan(*settings: str, world: int = 1):
    sets = ["model.preset=tiny_v41", "data.seq_length=1024",
            f"train.global_batch_size={world}", *settings]  # fmt: skip
    return plan_memory(resolve_run(load_config(overrides=sets), world=world))


def _rows(plan) -> dict[str, tuple[float, float]]:
    return {name: (d, h) for name, d, h, _ in plan.rows}


@pytest.mark.parametrize("placement,world", [("replicated", 1), ("sharded", 2), ("host", 1)])
def test_frozen_engram_tables_are_counted_where_they_are_placed(placement, world) -> None:
    (plan,) = _plan(f"model.engram.placement={placement}", world=world)
    rows = _rows(plan)
    share = sum(math.ceil(r * WIDTH / world) for r in TABLES) * 33 / 32  # FP8 + e8m0 per 32
    if placement == "host":
        assert rows["Engram tables, FP8 + e8m0, in host memory"] == (0, share)
    else:
        where = "replicated" if world == 1 else f"sharded over {world} ranks"
        assert rows[f"Engram tables, FP8 + e8m0 ({where})"] == (share, 0)
    # frozen tables are no weights, gradients nor optimizer state
    full = _rows(_plan("model.engram.trainable=true", world=world)[0])
    tables = sum(TABLES) * WIDTH
    assert full["weights (float32)"][0] - rows["weights (float32)"][0] == 4 * tables


def test_a_trainable_sharded_table_has_state_for_its_own_rows_only() -> None:
    sharded = _rows(_plan("model.engram.trainable=true", "model.engram.placement=sharded",
                          world=2)[0])  # fmt: skip
    frozen = _rows(_plan("model.engram.placement=sharded", world=2)[0])
    own = sum(math.ceil(r * WIDTH / 2) for r in TABLES)
    assert sharded["weights (float32)"][0] - frozen["weights (float32)"][0] == 4 * own
    moments = "fp32 Adam moments (2 per chunk)"
    assert sharded[moments][0] - frozen[moments][0] == 8 * own  # not split again over dp


def test_later_stages_receive_the_shared_caches() -> None:
    plans = _plan("parallel.pp=2", "parallel.pp_layout=Et*4|t*2L", "train.global_batch_size=4",
                  world=2)  # fmt: skip
    first, second = (_rows(p) for p in plans)
    name = "shared caches received from the stage before (x 1 micro-batch)"
    assert name not in first and name in second  # stage 1 opens with layer 4, a ratio-1 reuse
    cfg = DeepseekV41Config.preset("tiny_v41")
    t, p = 1024, 1024  # ratio-1 pool: one position per row
    assert second[name][0] == p * (cfg.kv_channels + cfg.index_head_dim) * 2 + t * 8 * (
        cfg.index_topk + cfg.candidate_topk_blocks
    )
    chunk = max(1, SCORE_ELEMS // (cfg.index_n_heads * p))
    scores = first["indexer scores, chunked by query rows"][0]
    assert scores == 4 * chunk * cfg.index_n_heads * p + 12 * chunk * p


def test_inspect_memory_prints_a_v41_plan(capsys) -> None:
    from primus_v4.cli import main

    assert main(["inspect", "memory", "--set", "model.preset=tiny_v41", "--set",
                 "data.seq_length=512", "--set", "model.engram.placement=host"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "memory plan per rank: world 1 = pp 1 x cp 1 x dp 1, ep 1; tiny_v41" in out
    assert "1 ratio1 reuse +engram layers: saved activations x 1 micro-batch" in out
    assert "Engram tables, FP8 + e8m0, in host memory" in out


def test_a_release_with_a_vision_tower_counts_its_image_encoder() -> None:
    """The golden release with a vision tower: the plan holds the frozen encoder (its
    parameters in float32, exactly those `load_image_encoder` makes) and the transient of
    encoding the largest image (the release's max_image_tokens); the text-only release adds
    neither."""
    from pathlib import Path

    from primus_v4.models.deepseek_v41.vision import load_image_encoder

    fixtures = Path(__file__).resolve().parents[2] / "fixtures"
    vision = fixtures / "dsv41_vision_golden" / "checkpoint"

    def rows(release: Path) -> dict[str, tuple[float, str]]:
        items = ["model.preset=null", f"model.pretrained={release}"]
        run = resolve_run(load_config(overrides=items), world=1)
        [plan] = plan_memory(run)
        return {name: (d, phase) for name, d, _, phase in plan.rows}

    got = rows(vision)
    params = sum(p.numel() for p in load_image_encoder(vision).parameters())
    held = got["image encoder (frozen)"]
    assert held == (params * 4, "static")
    # max_image_tokens 32: (32 - 2) x 9 = 270 patches; width 64, ffn 96, 4 heads
    patches = 270
    want = patches * (4 * 64 + 2 * 96) * 4 + 4 * patches * patches * 4
    assert got["encoding the largest image (no gradient)"] == (want, "backward")
    text = rows(fixtures / "dsv41_golden" / "checkpoint")
    assert not [name for name in text if "image" in name]


def test_trained_image_encoder_parts_are_model_parameters_with_saved_activations() -> None:
    """`model.vision.train`: the trained parts are counted with the model's parameters (weights,
    gradients, masters and moments grow by exactly their size), the frozen rest beside it, and
    what the trained parts save for backward per image token of a row (seq_length 256)."""
    from pathlib import Path

    from primus_v4.models.deepseek_v41.vision import load_image_encoder

    vision = Path(__file__).resolve().parents[2] / "fixtures/dsv41_vision_golden/checkpoint"
    encoder = load_image_encoder(vision)
    tower = sum(p.numel() for p in encoder.vision.parameters())
    rest = sum(p.numel() for p in encoder.parameters()) - tower

    def rows(train: str, *extra: str) -> dict[str, float]:
        items = ["model.preset=null", f"model.pretrained={vision}", "data.seq_length=256",
                 f"model.vision.train={train}", *extra]  # fmt: skip
        [plan] = plan_memory(resolve_run(load_config(overrides=items), world=1))
        return {name: d for name, d, _, _ in plan.rows}

    frozen, aligner, every = rows("frozen"), rows("aligner"), rows("all")
    assert frozen["image encoder (frozen)"] == (tower + rest) * 4
    assert aligner["image encoder (frozen tower)"] == tower * 4
    assert not [name for name in every if "frozen" in name]
    for got, trained in ((aligner, rest), (every, tower + rest)):
        assert got["weights (float32)"] - frozen["weights (float32)"] == trained * 4
        assert (got["fp32 gradient buckets (+ reduced shard)"]
                - frozen["fp32 gradient buckets (+ reduced shard)"]) == trained * 4  # fmt: skip
    # width 64, ffn 96, 2 blocks, 4 heads, LM width 128; 270 patches in the largest image
    per_token = (9 * 64 + 2 * 128) * 4
    key = "image encoder activations x 256 tokens"
    assert aligner[key] == per_token * 256
    per_token += 9 * 2 * (9 * 64 + 4 * 96) * 4
    assert every[key] == (per_token * 256 + 2 * 4 * 270 * 270 * 4)
    assert "encoding the largest image (no gradient)" not in every
    # LoRA on the tower: the model holds the whole encoder (frozen weights, counted once with
    # the model's), its activations saved as with `all`
    lora = rows("frozen", "model.lora.rank=4", "model.lora.targets=[wq_a,vision.wqkv]")
    assert not [name for name in lora if name.startswith("image encoder (frozen")]
    assert lora["weights (float32)"] > frozen["weights (float32)"]
    assert lora[key] == every[key]
