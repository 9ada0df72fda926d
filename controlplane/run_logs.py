"""The event log of a model's newest Dagster run, read from Dagster's own storage.

Deploy runs are partitioned by model version (``<model>.v<version>``, the run tag
``dagster/partition``). This reads the instance under ``$MODELPLANE_HOME/dagster`` directly
(its SQLite files, or whatever storage its ``dagster.yaml`` names), so it works with the
webserver down and with no network: the same records the Dagster UI's run page shows.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

PARTITION_TAG = "dagster/partition"
FINISHED = ("SUCCESS", "FAILURE", "CANCELED")


class NoRuns(Exception):
    """Nothing to show; the message says why and what to do."""


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    partition: str
    job_name: str
    status: str


def format_event(timestamp: float, level: int, step_key: str | None, message: str) -> str:
    """One line of a run's log: UTC time, level, step (``-`` for the run itself), message.

    >>> format_event(1800000000.25, logging.INFO, "quantized_model", "wrote int8 checkpoint")
    '2027-01-15 08:00:00 INFO    quantized_model  wrote int8 checkpoint'
    >>> format_event(1800000000.0, logging.ERROR, None, "run failed\\nTraceback")
    '2027-01-15 08:00:00 ERROR   -  run failed ↵ Traceback'
    """
    at = datetime.fromtimestamp(timestamp, timezone.utc)
    text = " ↵ ".join(part for part in message.strip().splitlines() if part.strip())
    return f"{at:%Y-%m-%d %H:%M:%S} {logging.getLevelName(level):<7} {step_key or '-'}  {text}"


def _is_version_of(model: str, partition: str) -> bool:
    """Whether ``partition`` is a version of ``model``, not of another whose name begins the same.

    >>> _is_version_of("gec", "gec.v3"), _is_version_of("gec", "gec.vx"), _is_version_of("gec", "gec.large.v3")
    (True, False, False)
    """
    name, sep, version = partition.rpartition(".v")
    return bool(sep) and name == model and version.isdigit()


class DagsterRunLogs:
    """Runs and their event logs in the Dagster instance at ``dagster_home``."""

    def __init__(self, dagster_home: Path) -> None:
        if not (dagster_home / "dagster.yaml").is_file():
            raise NoRuns(f"no Dagster instance at {dagster_home}: deploy runs exist once the platform has run "
                         "(`modelplane up`)")
        from dagster import DagsterInstance

        os.environ["DAGSTER_HOME"] = str(dagster_home)  # dagster.yaml reads its storage directory from it
        self._instance = DagsterInstance.from_config(str(dagster_home))

    def close(self) -> None:
        self._instance.dispose()

    def latest_run(self, model: str) -> RunInfo:
        """The newest run of any version of ``model`` (deploy, rollback or health check)."""
        from dagster import RunsFilter

        tags = self._instance.get_run_tags([PARTITION_TAG], value_prefix=f"{model}.v")
        partitions = sorted(value for _, values in tags for value in values if _is_version_of(model, value))
        runs = (self._instance.get_runs(filters=RunsFilter(tags={PARTITION_TAG: partitions}), limit=1)
                if partitions else [])
        if not runs:
            raise NoRuns(f"no Dagster run for model {model!r} yet: register a version in MLflow and point the "
                         "endpoint's alias at it, and the registry sensor starts its deploy run")
        run = runs[0]
        return RunInfo(run.run_id, run.tags.get(PARTITION_TAG, "?"), run.job_name, run.status.value)

    def status(self, run_id: str) -> str:
        run = self._instance.get_run_by_id(run_id)
        return "UNKNOWN" if run is None else run.status.value

    def last_lines(self, run_id: str, count: int, min_level: int = logging.NOTSET) -> tuple[list[str], int | None]:
        """The run's last ``count`` log lines at ``min_level`` or above, oldest first, and the storage id
        to follow on from (the run's newest record, shown or not)."""
        records = self._instance.get_records_for_run(run_id, ascending=True).records  # a run has hundreds
        shown = [r for r in records if r.event_log_entry.level >= min_level][-count:] if count > 0 else []
        return [self._line(r.event_log_entry) for r in shown], records[-1].storage_id if records else None

    def after(self, run_id: str, storage_id: int | None,
              min_level: int = logging.NOTSET) -> tuple[list[str], int | None]:
        """Lines at ``min_level`` or above logged after ``storage_id`` (None: from the start), and the newest
        storage id."""
        from dagster._core.storage.event_log.base import EventLogCursor

        cursor = None if storage_id is None else EventLogCursor.from_storage_id(storage_id).to_string()
        records = self._instance.get_records_for_run(run_id, cursor=cursor, ascending=True).records
        return ([self._line(r.event_log_entry) for r in records if r.event_log_entry.level >= min_level],
                records[-1].storage_id if records else storage_id)

    @staticmethod
    def _line(entry) -> str:
        message = entry.message or ""
        if not message.strip() and entry.dagster_event is not None:  # e.g. RUN_ENQUEUED, which says nothing
            message = entry.dagster_event.event_type_value.lower().replace("_", " ").replace("pipeline", "run")
        # a step or run failure says only that it failed; the error it failed with is beside it
        data = getattr(entry.dagster_event, "event_specific_data", None)
        error = getattr(data, "error", None)
        while getattr(error, "cause", None) is not None:  # Dagster wraps the op's own exception
            error = error.cause
        if error is not None and getattr(error, "message", None):
            message = f"{message} {error.message.strip()}"
        return format_event(entry.timestamp, entry.level, entry.step_key, message)
