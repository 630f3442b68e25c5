"""Run configuration: typed sections (schema), strict YAML loading (loader), world/model checks
(resolve)."""

from primus_v4.config.loader import (
    DEFAULT_CONFIG,
    build_config,
    dump_yaml,
    load_config,
    load_config_text,
    to_dict,
    write_resolved,
)
from primus_v4.config.resolve import ResolvedRun, resolve_run
from primus_v4.config.schema import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    OutputConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "DEFAULT_CONFIG",
    "CheckpointConfig",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "OutputConfig",
    "ParallelConfig",
    "ResolvedRun",
    "RunConfig",
    "TrainConfig",
    "build_config",
    "dump_yaml",
    "load_config",
    "load_config_text",
    "resolve_run",
    "to_dict",
    "write_resolved",
]
