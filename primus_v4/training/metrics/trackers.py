"""Experiment trackers (`output.tracker`: tensorboard, wandb or mlflow; rank 0 only): the same
numeric scalars as metrics.jsonl at each step, the resolved config as the run's parameters,
and loss.png plus metrics.jsonl as artifacts at the end.

Offline (`output.tracker_mode: offline`, the default) nothing leaves the machine: TensorBoard
event files under <output.dir>/tensorboard, a wandb offline run under <output.dir>/wandb
(`wandb sync` uploads it later), an MLflow file store under <output.dir>/mlruns
(`mlflow ui --backend-store-uri <output.dir>/mlruns` shows it).

A resumed run (a restart from a checkpoint into the same output.dir) continues the tracker run
it started: wandb and MLflow run ids are kept in <output.dir>/tracker_run.json; TensorBoard
appends to the same directory. Steps redone after the checkpoint are logged again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from primus_v4.config import RunConfig, to_dict
from primus_v4.config.preflight import tracker_available, tracker_missing
from primus_v4.durable import write_durable
from primus_v4.errors import ConfigError
from primus_v4.log import get_logger
from primus_v4.training.run_dirs import refuse_link

log = get_logger(__name__)

# MLflow takes at most 100 parameters per logged batch.
MLFLOW_PARAMS_PER_BATCH = 100
RUN_ID_FILE = "tracker_run.json"
TRACKER_DIRS = ("tensorboard", "wandb", "mlruns")  # what the libraries write under output.dir


class Tracker(Protocol):
    run_id: str | None

    def log_step(self, metrics: Any) -> None: ...
    def log_artifacts(self, paths: Iterable[Path]) -> None: ...
    def close(self) -> None: ...


def scalars(metrics: Any) -> dict[str, float]:
    """The metrics row's numbers (flags and not-evaluated None values are not scalars); a list
    (a drafter's per-slot acceptance) as one scalar per entry, `name_0`, `name_1`, ..."""
    out: dict[str, float] = {}
    for key, value in asdict(metrics).items():
        if isinstance(value, list):
            out.update({f"{key}_{i}": v for i, v in enumerate(value)})
        elif key != "step" and not isinstance(value, bool) and isinstance(value, int | float):
            out[key] = value
    return out


def flat_params(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as `section.key` -> value; lists, dicts and None as JSON text."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, bool | int | float | str):
            flat[prefix] = value
        else:
            flat[prefix] = json.dumps(value)

    walk("", to_dict(cfg))
    return flat


class TensorBoardTracker:
    run_id = None  # the directory is the run

    def __init__(self, cfg: RunConfig, out_dir: Path, run_id: str | None) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self._writer: Any = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        # The HPARAMS tab of this run: the config, written into the run's own event file.
        for summary in hparams(flat_params(cfg), {}):
            self._writer.file_writer.add_summary(summary)

    def log_step(self, metrics: Any) -> None:
        for key, value in scalars(metrics).items():
            self._writer.add_scalar(key, value, global_step=metrics.step)
        self._writer.flush()

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        import matplotlib.pyplot as plt

        for path in paths:  # images only: the scalars already hold metrics.jsonl
            if path.suffix == ".png":
                image = plt.imread(path)[..., :3]
                self._writer.add_image(path.stem, image, dataformats="HWC")
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    def __init__(self, cfg: RunConfig, out_dir: Path, run_id: str | None) -> None:
        import wandb

        self._run: Any = wandb.init(
            project=cfg.output.tracker_project,
            name=out_dir.name,
            dir=str(out_dir),
            mode=cfg.output.tracker_mode,
            config=to_dict(cfg),
            id=run_id,
            resume="allow" if run_id else None,
            settings=wandb.Settings(
                silent=True, console="off", x_disable_stats=True, x_save_requirements=False
            ),
        )
        self.run_id: str | None = self._run.id

    def log_step(self, metrics: Any) -> None:
        self._run.log(scalars(metrics), step=metrics.step)

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        for path in paths:
            self._run.save(str(path), base_path=str(path.parent), policy="now")

    def close(self) -> None:
        import wandb

        self._run.finish()
        # the service process writes the run's records: wait until it has flushed and exited,
        # so the offline run file is whole when this returns (a loaded machine lagged behind)
        wandb.teardown()


class MlflowTracker:
    def __init__(self, cfg: RunConfig, out_dir: Path, run_id: str | None) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if cfg.output.tracker_mode == "offline":
            # The file store (in maintenance upstream, still complete for runs, metrics, params
            # and artifacts) needs no database package and no server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (out_dir / "mlruns").absolute().as_uri()
        else:
            uri = os.environ["MLFLOW_TRACKING_URI"]  # checked at preflight
        self._client: Any = MlflowClient(tracking_uri=uri)
        if run_id is not None and self._resumable(run_id):  # its parameters are there already
            self._client.update_run(run_id, status="RUNNING")
            self.run_id: str | None = run_id
            return
        name = cfg.output.tracker_project
        experiment = self._client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id if experiment else self._client.create_experiment(name)
        )
        self.run_id = self._client.create_run(experiment_id, run_name=out_dir.name).info.run_id
        params = [Param(k, str(v)) for k, v in flat_params(cfg).items()]
        for start in range(0, len(params), MLFLOW_PARAMS_PER_BATCH):
            batch = params[start : start + MLFLOW_PARAMS_PER_BATCH]
            self._client.log_batch(self.run_id, params=batch)

    def _resumable(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self._client.get_run(run_id)
        except MlflowException:
            log.warning("output.tracker: mlflow run %s is not in the store; a new run", run_id)
            return False
        return True

    def log_step(self, metrics: Any) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(k, float(v), now, metrics.step) for k, v in scalars(metrics).items()]
        self._client.log_batch(self.run_id, metrics=rows)

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        for path in paths:
            self._client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


TRACKERS: dict[str, type] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}


def _previous_run_id(out_dir: Path, name: str) -> str | None:
    """The run id this output dir's earlier attempt recorded for tracker `name`, if any."""
    path = out_dir / RUN_ID_FILE
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("%s: unreadable (%s); the tracker starts a new run", path, exc)
        return None
    run_id = saved.get("id") if isinstance(saved, dict) else None
    if not isinstance(saved, dict) or not isinstance(run_id, str | None):
        log.warning("%s: not a tracker record ({\"tracker\": ..., \"id\": \"...\"}, got %s); "
                    "the tracker starts a new run", path, type(saved).__name__)  # fmt: skip
        return None
    return run_id if saved.get("tracker") == name else None


def open_tracker(cfg: RunConfig, out_dir: Path, *, resume: bool = False) -> Tracker | None:
    """The configured tracker, started (None for `none`), continuing the earlier attempt's run
    when `resume`; a missing package is one ConfigError line naming the pip extra."""
    name = cfg.output.tracker
    if name == "none":
        return None
    if cfg.output.tensorboard:
        log.info("output.tensorboard: true is read as output.tracker: tensorboard")
    if not tracker_available(name):
        raise ConfigError(tracker_missing(name))
    for planted in TRACKER_DIRS:  # the library writes below it: never into a planted link
        refuse_link(out_dir / planted, "output.dir")
    run_id = _previous_run_id(out_dir, name) if resume else None
    tracker = TRACKERS[name](cfg, out_dir, run_id)
    if tracker.run_id is not None:
        if run_id is not None:
            log.info("output.tracker: %s continues run %s", name, run_id)
        write_durable(out_dir / RUN_ID_FILE, json.dumps({"tracker": name, "id": tracker.run_id}))
    return tracker
