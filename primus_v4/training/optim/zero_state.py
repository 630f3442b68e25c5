"""The sharded optimizer's checkpoint state: every chunk as a DTensor of its flat parameter.

Rank r of the n replicas of a parameter holds the flat range [r c, (r + 1) c) of it (c =
ceil(N / n)), which is exactly a 1-D DTensor of global shape [N] with `Shard(0)` over the replica
mesh. DCP stores the global tensors once and hands any other n its own chunks on load, so a
checkpoint saved at dp = 2 resumes at dp = 1 and the reverse (DCP resharding).

Expert shards are [E / ep, ...] slices of a global [E, ...] tensor; their flat chunks are
`(Shard(0), Shard(0))` over the 2-D mesh (EP, expert-DP): the global flat [E x ...] split into
ep blocks (one EP rank's experts), each split into expert-DP chunks.

Rows owned over DP x CP (parameters tagged `global_shape`, e.g. a trainable sharded Engram
table: each rank holds rows [r ceil(R / n), ...) whole, no replicas) are dim-0 shards of their
[R, E] tensor over the DP x CP mesh.

Keys (flat, like the model's): `state.<param>.exp_avg`, `.exp_avg_sq`, `.step`, and `.master`
for parameters that are not float32 (a float32 parameter is its own master); `param_groups`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from primus_v4.training.optim.buckets import Slot
from primus_v4.training.optim.zero import ShardedAdamW

MOMENTS = ("exp_avg", "exp_avg_sq")


def _expert_mesh(opt: ShardedAdamW) -> Any:
    """The (EP, expert-DP) mesh of this rank's pipeline stage (a collective over the world)."""
    from torch.distributed.device_mesh import DeviceMesh

    ctx = opt.ctx
    mine = (ctx.pp.rank, ctx.ep.rank, ctx.expert_dp.rank, ctx.rank)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    grid = [[-1] * ctx.expert_dp.size for _ in range(ctx.ep.size)]
    for pp, ep, edp, rank in every:
        if pp == ctx.pp.rank:
            grid[ep][edp] = rank
    return DeviceMesh.from_group(
        [ctx.ep.group, ctx.expert_dp.group],
        ctx.device.type,
        mesh=torch.tensor(grid, dtype=torch.int),
        mesh_dim_names=("ep", "expert_dp"),
    )


class _Wrapper:
    """local chunk -> the DTensor (or plain tensor, unsharded) a checkpoint stores."""

    def __init__(self, opt: ShardedAdamW) -> None:
        self.opt = opt
        self._meshes: dict[str, Any] = {}

    def _mesh(self, kind: str) -> Any:
        if kind not in self._meshes:
            from torch.distributed.device_mesh import DeviceMesh

            ctx = self.opt.ctx
            if kind == "replicated":
                mesh = DeviceMesh.from_group(ctx.dp_cp.group, ctx.device.type)
            elif ctx.expert_dp.size > 1:
                mesh = _expert_mesh(self.opt)
            else:
                mesh = DeviceMesh.from_group(ctx.ep.group, ctx.device.type)
            self._meshes[kind] = mesh
        return self._meshes[kind]

    def __call__(self, slot: Slot, local: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor, Shard

        ctx = self.opt.ctx
        shape = getattr(slot.param, "global_shape", None)
        if shape is not None and not slot.expert:  # rows of [R, E] owned over DP x CP
            return DTensor.from_local(local.view(-1, shape[1]), self._mesh("replicated"),
                                      [Shard(0)], run_check=False, shape=shape,
                                      stride=(shape[1], 1))  # fmt: skip
        if slot.expert:
            parts = (ctx.ep.size > 1) + (ctx.expert_dp.size > 1)
            numel = slot.numel * ctx.ep.size
            mesh = self._mesh("experts")
        else:
            parts = int(ctx.dp_cp.size > 1)
            numel = slot.numel
            mesh = self._mesh("replicated") if parts else None
        if not parts:
            return local
        return DTensor.from_local(local, mesh, [Shard(0)] * parts, run_check=False,
                                  shape=(numel,), stride=(1,))  # fmt: skip


def _saves_master(slot: Slot) -> bool:
    return slot.param.dtype != torch.float32


def optimizer_state(opt: ShardedAdamW) -> dict[str, Any]:
    """The DCP state dict of `opt` (load it back with `load_optimizer_state`)."""
    wrap = _Wrapper(opt)
    out: dict[str, Any] = {}
    for s in opt.slots:
        state = opt.state[s.master]
        for key in MOMENTS:
            out[f"state.{s.name}.{key}"] = wrap(s, state[key])
        if _saves_master(s):
            out[f"state.{s.name}.master"] = wrap(s, s.master)
        out[f"state.{s.name}.step"] = state["step"]
    out["param_groups"] = {
        str(i): {k: v for k, v in g.items() if k != "params"}
        for i, g in zip(opt._index, opt.param_groups, strict=True)
    }
    return out


@torch.no_grad()
def load_optimizer_state(opt: ShardedAdamW, loaded: dict[str, Any]) -> None:
    """Copy a loaded `optimizer_state` dict into `opt` (after the model's weights were loaded:
    float32 masters are the parameters, other masters come from the checkpoint)."""
    from torch.distributed.tensor import DTensor

    def local(value: Any) -> torch.Tensor:
        return value.to_local() if isinstance(value, DTensor) else value

    for s in opt.slots:
        state = opt.state[s.master]
        # DCP loads into the tensors `optimizer_state` handed out, often these very ones.
        for key in MOMENTS:
            state[key].copy_(local(loaded[f"state.{s.name}.{key}"]).view(-1))  # rows: [r, E]
        if _saves_master(s):
            s.master.copy_(local(loaded[f"state.{s.name}.master"]).view(-1))
        elif not s.aliased:
            s.master.copy_(s.param.detach().view(-1)[s.lo : s.hi])  # a host copy of fp32
        state["step"].copy_(local(loaded[f"state.{s.name}.step"]))
    for i, g in zip(opt._index, opt.param_groups, strict=True):
        g.update(loaded["param_groups"][str(i)])
    opt._sync_hyperparams()
    opt.write_back()
