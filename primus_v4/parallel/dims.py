"""The sizes of every parallel axis, derived and checked once (torch-free: config validation
and `--dry-run` use it without loading torch).

Layout (megatron-core, tp = etp = 1):
  dense ranks:  world = pp x cp x dp
  expert ranks: world = pp x ep x edp, independent of cp (ep spans dp x cp ranks)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from primus_v4.errors import ConfigError
from primus_v4.parallel.pipeline_layout import plan_stages


@dataclass(kw_only=True)
class ParallelDims:
    """Sizes of every parallel axis; `dp` is derived as world / (pp x cp).

    world: total number of ranks.
    tp: tensor parallel; must be 1 (see `validate`).
    pp: pipeline stages.
    cp: context parallel (the pack split contiguously over cp ranks).
    ep: expert parallel (experts sharded over ep ranks; folds over dp x cp).
    etp: expert tensor parallel; must be 1 like tp.
    """

    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = field(init=False)

    def __post_init__(self) -> None:
        self.validate()
        self.dp = self.world // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert shard: world / (ep x etp x pp), as megatron lays it out."""
        return self.world // (self.ep * self.etp * self.pp)

    def validate(self) -> None:
        for name in ("world", "tp", "pp", "cp", "ep", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel.{name} must be a positive integer, got {value!r}")
        if self.tp != 1 or self.etp != 1:
            # The single shared KV latent, the indexer scores and the compressed pools have no
            # head axis worth sharding: long context scales with CP and experts with EP.
            raise ConfigError(
                f"tensor parallelism is deliberately absent in primus_v4 (got tp={self.tp}, "
                f"etp={self.etp}); use cp for long context and ep for experts, with tp=etp=1"
            )
        if self.world % (self.pp * self.cp):
            raise ConfigError(
                f"world size {self.world} is not divisible by parallel.pp x parallel.cp = "
                f"{self.pp} x {self.cp} = {self.pp * self.cp} (world = pp x cp x dp)"
            )
        dp = self.world // (self.pp * self.cp)
        if (dp * self.cp) % (self.ep * self.etp):
            # Same condition as world % (ep x etp x pp) == 0: expert-DP x EP x ETP x PP must
            # tile the world just as DP x CP x TP x PP does.
            raise ConfigError(
                f"parallel.ep={self.ep} must divide dp x cp = {dp} x {self.cp} = {dp * self.cp} "
                f"(world {self.world} / pp {self.pp}); experts fold over the data and "
                "context parallel ranks of one pipeline stage"
            )

    def check_model(
        self,
        *,
        num_layers: int,
        num_experts: int | None = None,
        pp_layout: str | None = None,
        mtp_num_layers: int = 0,
        seq_length: int | None = None,
        cp_min_rows: int = 1,
    ) -> None:
        """Model-dependent checks, each written once: layers per pipeline stage, experts per EP
        rank, and rows per CP rank (`cp_min_rows`: the boundary rows a rank hands to its
        right neighbour)."""
        if self.pp > 1 and pp_layout is None and num_layers < self.pp:
            raise ConfigError(
                f"parallel.pp={self.pp} exceeds the model's num_layers={num_layers}: every "
                "pipeline stage needs at least one decoder layer"
            )
        try:  # the stage plan the pipeline engine will build, checked against the model
            plan_stages(
                pp=self.pp, num_layers=num_layers, mtp_num_layers=mtp_num_layers, layout=pp_layout
            )
        except ConfigError as exc:
            raise ConfigError(f"parallel.pp / parallel.pp_layout: {exc}") from None
        if self.ep > 1 and not num_experts:
            raise ConfigError(f"parallel.ep={self.ep} needs an MoE model (num_moe_experts unset)")
        if num_experts and num_experts % self.ep:
            raise ConfigError(
                f"parallel.ep={self.ep} must divide the model's num_moe_experts={num_experts} "
                "(each EP rank holds experts / ep of them)"
            )
        if seq_length is not None and self.cp > 1 and seq_length // self.cp < cp_min_rows:
            raise ConfigError(
                f"data.seq_length={seq_length} over parallel.cp={self.cp} leaves "
                f"{seq_length // self.cp} rows per rank, fewer than the {cp_min_rows} "
                "boundary rows a rank hands to its neighbour (sliding window - 1, compressor "
                f"windows); use cp <= {max(seq_length // cp_min_rows, 1)} or a longer "
                "data.seq_length"
            )
