"""The inference log: sampled requests through the router and their answers, kept in the
control-plane database.

The router samples requests, buffers their records in memory and writes them here in
batches (``serving.router.inference_log.InferenceLogWriter``); ``modelplane requests``
reads them back or exports them to Parquet. Times are stored and returned in UTC.
"""

from __future__ import annotations

import re
from dataclasses import astuple, dataclass, fields
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Sequence

from sqlalchemy import Engine, delete, insert, select

from controlplane.schema import InferenceLogRow

# serve: the answer the caller got; canary: the same, from the canary revision of a split;
# shadow: a shadow revision's answer to a copy of the request (never returned to the caller).
KINDS = ("serve", "canary", "shadow")
EXPORT_CHUNK_ROWS = 10_000  # rows read from the database and written to Parquet at a time


@dataclass(frozen=True, slots=True)
class InferenceRecord:
    """One sampled request and its answer, as the router saw them."""

    at: datetime  # when the request arrived
    endpoint: str
    kind: str  # serve | canary | shadow (KINDS)
    status: int  # HTTP status of the answer
    latency_ms: float
    request_bytes: int  # full body sizes, even when the payloads below were cut or not kept
    response_bytes: int
    revision_id: str | None = None  # None: no revision answered (refused before routing)
    token_id: str | None = None
    router_id: str | None = None
    request_payload: str | None = None  # cut at the router's cap (``capped``); None: not kept
    response_payload: str | None = None


COLUMNS = tuple(f.name for f in fields(InferenceRecord))


def _utc(moment: datetime) -> datetime:
    """Aware and in UTC. A naive time is taken to be UTC already (SQLite returns naive times)."""
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)


def _record(row) -> InferenceRecord:
    values = dict(zip(COLUMNS, row))
    values["at"] = _utc(values["at"])
    return InferenceRecord(**values)


class InferenceLogStore:
    """Writes batches of :class:`InferenceRecord`, reads them back, exports and prunes them."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._table = InferenceLogRow.__table__
        self._columns = [self._table.c[name] for name in COLUMNS]

    def write(self, records: Sequence[InferenceRecord]) -> None:
        """Insert ``records`` in one transaction, as one executemany."""
        if not records:
            return
        rows = [dict(zip(COLUMNS, astuple(r)), at=_utc(r.at)) for r in records]
        with self._engine.begin() as connection:
            connection.execute(insert(self._table), rows)

    def recent(self, endpoint: str, since: datetime, limit: int = 100,
               kind: str | None = None) -> list[InferenceRecord]:
        """The endpoint's records from ``since`` on, newest first, at most ``limit``."""
        query = (self._matching(endpoint, since, kind)
                 .order_by(self._table.c.at.desc(), self._table.c.id.desc()).limit(limit))
        with self._engine.connect() as connection:
            return [_record(row) for row in connection.execute(query)]

    def export_parquet(self, endpoint: str, since: datetime, path: Path | str, kind: str | None = None,
                       chunk_rows: int = EXPORT_CHUNK_ROWS) -> int:
        """Write the endpoint's records from ``since`` on to a Parquet file, oldest first; the number of rows.

        Rows are read and written ``chunk_rows`` at a time (a server-side cursor on PostgreSQL),
        so a large log never has to fit in memory. The file has :func:`parquet_schema` even
        when no row matched.
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = parquet_schema()
        query = self._matching(endpoint, since, kind).order_by(self._table.c.at, self._table.c.id)
        written = 0
        with self._engine.connect() as connection, pq.ParquetWriter(str(path), schema) as parquet:
            result = connection.execution_options(stream_results=True, yield_per=chunk_rows).execute(query)
            for rows in result.partitions(chunk_rows):
                columns = [list(column) for column in zip(*rows)]
                columns[0] = [_utc(at) for at in columns[0]]
                parquet.write_batch(pa.record_batch(columns, schema=schema))
                written += len(rows)
        return written

    def _matching(self, endpoint: str, since: datetime, kind: str | None):
        if kind is not None and kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        query = select(*self._columns).where(self._table.c.endpoint == endpoint, self._table.c.at >= _utc(since))
        return query if kind is None else query.where(self._table.c.kind == kind)

    def prune(self, older_than: datetime, endpoint: str | None = None) -> int:
        """Delete every record (of ``endpoint``, or of all) from before ``older_than`` (retention);
        the number deleted."""
        condition = self._table.c.at < _utc(older_than)
        if endpoint is not None:
            condition = condition & (self._table.c.endpoint == endpoint)
        with self._engine.begin() as connection:
            return connection.execute(delete(self._table).where(condition)).rowcount


def parquet_schema():
    """The Parquet columns of an export: the fields of :class:`InferenceRecord`, times in UTC."""
    import pyarrow as pa

    return pa.schema([
        pa.field("at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("endpoint", pa.string(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("status", pa.int32(), nullable=False),
        pa.field("latency_ms", pa.float64(), nullable=False),
        pa.field("request_bytes", pa.int64(), nullable=False),
        pa.field("response_bytes", pa.int64(), nullable=False),
        pa.field("revision_id", pa.string()),
        pa.field("token_id", pa.string()),
        pa.field("router_id", pa.string()),
        pa.field("request_payload", pa.string()),
        pa.field("response_payload", pa.string()),
    ])


_SINCE = re.compile(r"(\d+)([smhd]?)")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str) -> timedelta:
    """How far back ``--since`` reaches: a whole number and a unit, s, m, h or d (none: seconds).

    >>> parse_since("10m"), parse_since("2h"), parse_since("90")
    (datetime.timedelta(seconds=600), datetime.timedelta(seconds=7200), datetime.timedelta(seconds=90))
    >>> parse_since("yesterday")
    Traceback (most recent call last):
    ...
    ValueError: --since must be a whole number with s, m, h or d (e.g. 30s, 10m, 2h, 1d), got 'yesterday'
    """
    match = _SINCE.fullmatch(text.strip().lower())
    if match is None:
        raise ValueError(f"--since must be a whole number with s, m, h or d (e.g. 30s, 10m, 2h, 1d), got {text!r}")
    amount = int(match.group(1))
    if amount == 0:
        raise ValueError(f"--since must be more than zero, got {text!r}")
    return timedelta(seconds=amount * _UNIT_S[match.group(2)])
