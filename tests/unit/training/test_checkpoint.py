"""Checkpoints: resumed == uninterrupted, and a save killed midway is never loaded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from primus_v4.parallel.groups import ParallelContext
from primus_v4.training.checkpoint import store as checkpoint
from primus_v4.training.checkpoint.store import CheckpointManager
from primus_v4.training.optim.lr_schedule import warmup_cosine
from primus_v4.training.optim.zero import ShardedAdamW

HERE = Path(__file__).resolve().parent


class ToyData:
    """A data stream whose position is part of the training state."""

    def __init__(self) -> None:
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + self.position)
        self.position += 1
        return torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def make_state(seed: int = 0, offload: float = 0.5) -> dict:
    torch.manual_seed(seed)
    # Dropout makes the loss depend on the global RNG, which the checkpoint must restore.
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.LayerNorm(16), nn.Linear(16, 2))
    opt = ShardedAdamW(list(model.named_parameters()), ParallelContext.single(), lr=1e-2,
                       betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                       offload_fraction=offload)  # fmt: skip
    sched = LambdaLR(opt, warmup_cosine(lr=1e-2, min_lr=1e-3, warmup_steps=2, total_steps=6))
    return {"model": model, "optimizer": opt, "scheduler": sched, "data": ToyData()}


def train(state: dict, start: int, stop: int, manager: CheckpointManager | None) -> list[float]:
    losses = []
    for step in range(start, stop):
        x, y = state["data"].next()
        state["optimizer"].zero_grad()
        loss = (state["model"](x) - y).pow(2).mean()
        loss.backward()
        state["optimizer"].reduce_gradients()
        state["optimizer"].step()
        state["scheduler"].step()
        losses.append(loss.item())
        if manager is not None:
            manager.maybe_save(step + 1, final=step + 1 == stop, **state)
    return losses


def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    torch.manual_seed(123)
    reference = train(make_state(), 0, 6, None)

    torch.manual_seed(123)
    first = train(make_state(), 0, 3, CheckpointManager(tmp_path, interval=3))
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"

    torch.manual_seed(999)  # a fresh process: other weights, other RNG; all must be restored
    state = make_state(seed=5, offload=0.0)  # resuming under another offload split is allowed
    manager = CheckpointManager(tmp_path, interval=3)
    assert manager.load_latest(**state) == 3
    rest = train(state, 3, 6, manager)
    assert first + rest == reference  # exact: same ops, same RNG, same data
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step_00000003",
        "step_00000006",
    ]


def test_no_checkpoint_and_resume_off(tmp_path: Path) -> None:
    state = make_state()
    assert CheckpointManager(tmp_path / "none", interval=1).load_latest(**state) is None
    train(state, 0, 1, CheckpointManager(tmp_path, interval=1))
    assert CheckpointManager(tmp_path, interval=1, resume=False).load_latest(**state) is None
    assert checkpoint.find_latest(tmp_path) == tmp_path / "step_00000001"


def save_then_die(root: str) -> None:
    """Child process: complete save at 3, then a save at 6 that is SIGKILLed before publishing."""
    torch.manual_seed(123)
    state = make_state()
    train(state, 0, 3, CheckpointManager(root, interval=3))

    def killed(*args: object) -> None:  # all shards of step 6 are on disk, nothing published
        os.kill(os.getpid(), signal.SIGKILL)

    checkpoint._publish = killed
    train(state, 3, 6, CheckpointManager(root, interval=3))


def test_killed_save_is_ignored(tmp_path: Path) -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_checkpoint as t; "
        f"t.save_then_die({str(tmp_path)!r})"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert (tmp_path / ".tmp_step_00000006" / ".metadata").is_file()
    assert not (tmp_path / "step_00000006").exists()

    torch.manual_seed(123)
    reference = make_state()
    train(reference, 0, 3, None)
    state = make_state(seed=7)
    assert CheckpointManager(tmp_path, interval=3).load_latest(**state) == 3
    for a, b in zip(reference["model"].parameters(), state["model"].parameters(), strict=True):
        assert torch.equal(a, b)
    # The next save of step 6 replaces the leftover temp dir and publishes normally.
    train(state, 3, 6, CheckpointManager(tmp_path, interval=3))
    assert checkpoint.find_latest(tmp_path) == tmp_path / "step_00000006"
    assert not (tmp_path / ".tmp_step_00000006").exists()


def test_a_checkpoint_of_another_model_layout_is_refused_by_name(tmp_path: Path) -> None:
    """A checkpoint written before the released architecture (no `model_layout` in COMPLETE:
    experts were [E, in, out] under the same names) is refused before anything is read."""
    import json

    import pytest

    from primus_v4.errors import PrimusError

    train(make_state(), 0, 3, CheckpointManager(tmp_path, interval=3))
    complete = tmp_path / "step_00000003" / "COMPLETE"
    info = json.loads(complete.read_text())
    assert info["model_layout"] == checkpoint.MODEL_LAYOUT
    del info["model_layout"]
    complete.write_text(json.dumps(info))
    state = make_state(seed=5)
    before = [p.detach().clone() for p in state["model"].parameters()]
    with pytest.raises(PrimusError, match=r"step_00000003 holds model layout 1; this primus_v4 "
                       r"reads layout 2 .*cannot be resumed or exported"):  # fmt: skip
        CheckpointManager(tmp_path, interval=3).load_latest(**state)
    after = state["model"].parameters()
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_plain_torch_optimizer_is_refused_by_name(tmp_path: Path) -> None:
    import pytest

    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"ShardedAdamW, not of AdamW"):
        checkpoint.save(
            tmp_path, step=1, model=model, optimizer=torch.optim.AdamW(model.parameters())
        )


def test_a_checkpoint_missing_a_tensor_is_one_line_naming_it(tmp_path: Path) -> None:
    """A model with a tensor the checkpoint lacks: DCP raises each rank's whole traceback; the
    error says the wrapped cause on one line."""
    import pytest

    from primus_v4.errors import CheckpointError

    train(make_state(), 0, 3, CheckpointManager(tmp_path, interval=3))
    state = make_state(seed=5)
    state["model"].add_module("extra", nn.Linear(2, 2))
    with pytest.raises(CheckpointError) as err:
        CheckpointManager(tmp_path, interval=3).load_latest(**state)
    message = str(err.value)
    assert "Traceback" not in message and "\n" not in message, message
    assert "extra.weight" in message, message
