"""MLflow: each logging rank is a run of experiment `monitor.mlflow.experiment` (default `run.name`,
so a sweep's runs share one), named `<group>/<rank>` and tagged `rft.group` / `rft.rank`, with the
resolved config as its parameters.

Metrics go through MLflow's own asynchronous batching (`log_batch(synchronous=False)`), so a slow
server costs no step time; `flush()` before each checkpoint makes every step up to it durable. A
resumed rank reopens its run (id in `metrics/<rank>.trackers.json`) and asks the server which steps
each metric already has: the steps it logs again after its checkpoint (a bit-for-bit resume
computes the same values) are sent only where the server lacks them, so the history has each step
once and none missing.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from rft.runtime.trackers import TRACKERS, TrackedRun, flat_params

MAX_PARAM_CHARS = 6000  # MLflow's limit on a parameter's value
PARAMS_PER_BATCH = 100  # MLflow's limit on parameters per log_batch
MAX_PENDING = 256  # asynchronous batches in flight before log() waits on them (flush, before a checkpoint, also does)


def tracking_uri(cfg: Any) -> str:
    """monitor.mlflow.tracking_uri, else $MLFLOW_TRACKING_URI, else an SQLite store in the run
    directory (MLflow 3 keeps its file store in maintenance mode)."""
    return (cfg.monitor.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{os.path.join(cfg.run.output_dir, 'mlflow.db')}")


def client(uri: str):
    """An MlflowClient that gives up on a server that does not answer within seconds, not after
    MLflow's default of 7 retries with exponential backoff (minutes of a rank's start-up)."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    from mlflow import MlflowClient

    for name in ("mlflow", "alembic"):  # a new store's set-up chatter (after import: mlflow sets its level then)
        logging.getLogger(name).setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=uri)


def experiment_id(mlflow_client, name: str) -> str:
    """The experiment's id; created if absent (by whichever rank or launcher comes first)."""
    from mlflow.exceptions import MlflowException

    found = mlflow_client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return mlflow_client.create_experiment(name)
    except MlflowException:  # another rank created it in between
        return mlflow_client.get_experiment_by_name(name).experiment_id


@TRACKERS.register("mlflow")
class MlflowTracker:
    def __init__(self, cfg: Any, run: TrackedRun):
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        self.client = client(tracking_uri(cfg))
        self.run_id, self.logged, self.pending = run.saved_id("mlflow"), {}, []
        if self.run_id is not None:
            try:
                self.client.update_run(self.run_id, status="RUNNING")
                self.logged = self._logged_steps()
            except MlflowException:  # the run is gone (deleted, another server): a new one
                self.run_id = None
        if self.run_id is None:
            experiment = experiment_id(self.client, cfg.monitor.mlflow.experiment or cfg.run.name)
            tags = {"rft.group": run.group, "rft.rank": run.rank_name, "rft.run_dir": run.run_dir,
                    **cfg.monitor.mlflow.tags}
            self.run_id = self.client.create_run(experiment, run_name=run.name, tags=tags).info.run_id
            run.save_id("mlflow", self.run_id)
            params = [Param(key, value[:MAX_PARAM_CHARS]) for key, value in flat_params(cfg).items()]
            for start in range(0, len(params), PARAMS_PER_BATCH):
                self.client.log_batch(self.run_id, params=params[start:start + PARAMS_PER_BATCH])
        if run.resume_step is not None:
            # batches still in flight when the rank was killed -9 never reached the server, also of
            # steps up to the checkpoint, which the resumed rank does not log again (seen: the
            # checkpoint step's own scalars, logged after the flush that precedes its save). The
            # jsonl has them (its steps from the checkpoint on are already dropped); `log` sends only
            # what the server lacks.
            for step, scalars in run.logged_steps():
                self.log(step, scalars)

    def _logged_steps(self) -> dict[str, set[int]]:
        """metric -> the steps the server holds for it: a set, not the last one, since asynchronous
        batches can arrive out of order and a killed rank's lost one leaves a gap below its last."""
        keys = self.client.get_run(self.run_id).data.metrics
        return {key: {m.step for m in self.client.get_metric_history(self.run_id, key)} for key in keys}

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in scalars.items()
                   if step not in self.logged.get(key, ())]
        if metrics:
            self.pending.append(self.client.log_batch(self.run_id, metrics=metrics, synchronous=False))
        if len(self.pending) >= MAX_PENDING:  # a run that never checkpoints would keep every handle
            self.flush()

    def flush(self) -> None:
        # each batch's own handle: mlflow.flush_async_logging() would open MLflow's default store
        # (an mlflow.db in the working directory) to find the queue
        for operation in self.pending:
            operation.wait()
        self.pending = []

    def close(self) -> None:
        self.flush()
        self.client.set_terminated(self.run_id)
