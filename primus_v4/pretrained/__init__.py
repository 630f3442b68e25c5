"""Released checkpoints in and out: the one load/export flow the trainer and the CLI call.

`load`: a release directory (config.json + safetensors shards, FP8/FP4 or bf16) into a whole
model or into one rank's slice of it (pipeline stage, expert shard). `save`: a model's state,
or any stream of its state-dict tensors (a training checkpoint being exported), out in the
release layout. The format itself (shards, FP8/FP4 codec) is `primus_v4.checkpoint_formats`;
the DeepSeek-V4 names are its state-dict adapter, `models/deepseek_v4/state_dict_adapter.py`.
"""

from primus_v4.pretrained.load import (
    RankLoad,
    load_pretrained,
    load_rank_weights,
    rank_loader,
    read_config,
)
from primus_v4.pretrained.save import save_pretrained, write_release_state

__all__ = [
    "RankLoad",
    "load_pretrained",
    "load_rank_weights",
    "rank_loader",
    "read_config",
    "save_pretrained",
    "write_release_state",
]
