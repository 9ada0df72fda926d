"""The router's inference log: the store (SQLite and PostgreSQL), the asynchronous writer, the
sampling and capping helpers and ``modelplane requests``."""

from __future__ import annotations

import asyncio
import inspect
from datetime import datetime, timedelta, timezone

import pyarrow.parquet as pq
import pytest
from sqlalchemy import inspect as inspect_db
from typer.testing import CliRunner

from controlplane import db
from controlplane.inference_log import InferenceLogStore, InferenceRecord, parse_since
from serving.router.inference_log import InferenceLogWriter, MemorySink, capped, sample

T0 = datetime(2027, 1, 15, 8, 0, tzinfo=timezone.utc)


def record(seconds: float = 0.0, endpoint: str = "gec", kind: str = "serve", status: int = 200,
           **extra) -> InferenceRecord:
    return InferenceRecord(at=T0 + timedelta(seconds=seconds), endpoint=endpoint, kind=kind, status=status,
                           latency_ms=12.5, request_bytes=20, response_bytes=40, **extra)


def run(coroutine, timeout_s: float = 10.0):
    """Run a scenario; a writer that blocks fails the test by timing out instead of hanging it."""
    return asyncio.run(asyncio.wait_for(coroutine, timeout_s))


async def resuming(sink: MemorySink, scenario):
    """Run ``scenario`` and resume ``sink`` however it ends: a failed assertion must not leave a write
    thread hanging, or ``asyncio.run`` (which waits for its threads) hangs the test run."""
    try:
        return await scenario
    finally:
        sink.resume()


# The migration.

def test_migration_0007_adds_the_log_and_the_traffic_split_and_downgrade_removes_them(database_url):
    db.upgrade(database_url)
    engine = db.make_engine(database_url)
    inspector = inspect_db(engine)
    assert "inference_log" in inspector.get_table_names()
    assert [i["column_names"] for i in inspector.get_indexes("inference_log")] == [["endpoint", "at"]]
    traffic = {c["name"]: c for c in inspector.get_columns("traffic")}
    for column in ("canary_revision_id", "canary_percent", "shadow_revision_id", "shadow_percent"):
        assert traffic[column]["nullable"], column
    engine.dispose()

    db.downgrade(database_url, "0006")
    engine = db.make_engine(database_url)
    inspector = inspect_db(engine)
    assert "inference_log" not in inspector.get_table_names()
    assert {c["name"] for c in inspector.get_columns("traffic")} == {"endpoint", "revision_id", "updated_at"}
    engine.dispose()


# The store.

def test_written_records_come_back_newest_first_with_every_field(migrated_engine):
    store = InferenceLogStore(migrated_engine)
    full = record(5, revision_id="gec-v2", token_id="tok1", router_id="host:8080:1",
                  request_payload='{"text": "hi"}', response_payload='{"text": "Hi."}')
    store.write([record(0), full, record(3, kind="shadow", status=500), record(1, kind="canary")])

    assert store.recent("gec", T0) == [full, record(3, kind="shadow", status=500), record(1, kind="canary"), record(0)]
    assert store.recent("gec", T0, limit=1) == [full]
    assert store.recent("gec", T0 + timedelta(seconds=4)) == [full]
    assert store.recent("gec", T0, kind="shadow") == [record(3, kind="shadow", status=500)]
    assert store.recent("gec", T0, kind="canary") == [record(1, kind="canary")]
    assert store.recent("iris", T0) == []
    assert store.recent("gec", T0)[0].at.tzinfo is not None


def test_times_in_other_zones_are_stored_as_the_same_moment(migrated_engine):
    store = InferenceLogStore(migrated_engine)
    plus_two = timezone(timedelta(hours=2))
    store.write([InferenceRecord(at=(T0 + timedelta(seconds=1)).astimezone(plus_two), endpoint="gec", kind="serve",
                                 status=200, latency_ms=1.0, request_bytes=1, response_bytes=1)])
    [back] = store.recent("gec", T0.astimezone(plus_two))
    assert back.at == T0 + timedelta(seconds=1) and back.at.utcoffset() == timedelta(0)


def test_an_unknown_kind_is_refused(migrated_engine):
    with pytest.raises(ValueError, match="serve, canary, shadow"):
        InferenceLogStore(migrated_engine).recent("gec", T0, kind="replay")


def test_prune_deletes_only_records_older_than_the_cutoff(migrated_engine):
    store = InferenceLogStore(migrated_engine)
    store.write([record(s) for s in range(10)])
    assert store.prune(T0 + timedelta(seconds=4)) == 4
    assert [r.at for r in store.recent("gec", T0 - timedelta(days=1))] == [
        T0 + timedelta(seconds=s) for s in range(9, 3, -1)]


def test_prune_of_one_endpoint_leaves_the_others(migrated_engine):
    store = InferenceLogStore(migrated_engine)
    store.write([record(s) for s in range(3)] + [record(s, endpoint="iris") for s in range(3)])
    assert store.prune(T0 + timedelta(seconds=10), "iris") == 3
    assert len(store.recent("gec", T0 - timedelta(days=1))) == 3


def test_export_writes_every_matching_record_to_parquet_in_chunks_oldest_first(migrated_engine, tmp_path):
    store = InferenceLogStore(migrated_engine)
    store.write([record(s, revision_id="gec-v1", request_payload=f"request {s}") for s in range(25)]
                + [record(1, endpoint="iris")])
    path = tmp_path / "gec.parquet"

    assert store.export_parquet("gec", T0 + timedelta(seconds=5), path, chunk_rows=7) == 20
    assert store.export_parquet("gec", T0, tmp_path / "shadow.parquet", kind="shadow") == 0

    table = pq.read_table(path)
    assert table.num_rows == 20
    assert table.column_names == ["at", "endpoint", "kind", "status", "latency_ms", "request_bytes",
                                  "response_bytes", "revision_id", "token_id", "router_id", "request_payload",
                                  "response_payload"]
    assert str(table.schema.field("at").type) == "timestamp[us, tz=UTC]"
    first = table.slice(0, 1).to_pylist()[0]
    assert first["at"] == T0 + timedelta(seconds=5)
    assert first["request_payload"] == "request 5" and first["response_payload"] is None
    assert set(table.column("endpoint").to_pylist()) == {"gec"}


def test_an_export_with_no_matching_record_is_an_empty_file_with_the_columns(migrated_engine, tmp_path):
    path = tmp_path / "none.parquet"
    assert InferenceLogStore(migrated_engine).export_parquet("gec", T0, path) == 0
    table = pq.read_table(path)
    assert table.num_rows == 0 and "latency_ms" in table.column_names


@pytest.mark.parametrize("text, expected", [
    ("30s", timedelta(seconds=30)),
    ("10m", timedelta(minutes=10)),
    ("2h", timedelta(hours=2)),
    ("1d", timedelta(days=1)),
    ("90", timedelta(seconds=90)),
    (" 5M ", timedelta(minutes=5)),
])
def test_parse_since(text, expected):
    assert parse_since(text) == expected


@pytest.mark.parametrize("text", ["", "m", "10 minutes", "1w", "-5m", "1.5h", "0m", "yesterday"])
def test_parse_since_refuses_anything_else(text):
    with pytest.raises(ValueError, match="--since"):
        parse_since(text)


# The writer.

def test_offer_is_synchronous_and_a_full_buffer_drops_and_counts():
    writer = InferenceLogWriter(MemorySink(), max_buffer=3, batch_size=10)
    assert not inspect.iscoroutinefunction(writer.offer)

    accepted = [writer.offer(record(s)) for s in range(5)]  # no event loop: offer never needs one

    assert accepted == [True, True, True, False, False]
    assert (writer.buffered, writer.dropped, writer.written) == (3, 2, 0)


def test_a_full_batch_is_written_without_waiting_for_the_interval():
    async def scenario():
        sink = MemorySink()
        writer = InferenceLogWriter(sink, batch_size=3, flush_interval_s=3600)
        task = asyncio.create_task(writer.run())
        for s in range(3):
            writer.offer(record(s))
        while writer.written < 3:
            await asyncio.sleep(0.001)
        assert sink.batches == [[record(0), record(1), record(2)]]
        await writer.close()
        await task

    run(scenario())


def test_a_partial_batch_is_written_after_the_flush_interval():
    async def scenario():
        sink = MemorySink()
        writer = InferenceLogWriter(sink, batch_size=100, flush_interval_s=0.01)
        task = asyncio.create_task(writer.run())
        writer.offer(record(0))
        while writer.written < 1:
            await asyncio.sleep(0.001)
        assert sink.records == [record(0)] and writer.buffered == 0
        await writer.close()
        await task

    run(scenario())


def test_records_offered_during_a_write_wait_for_the_next_flush_instead_of_a_write_of_their_own():
    """A busy router writes a batch per interval, not every few records as they arrive."""
    sink = MemorySink()

    async def scenario():
        writer = InferenceLogWriter(sink, batch_size=3, flush_interval_s=3600)
        task = asyncio.create_task(writer.run())
        sink.pause()
        for s in range(3):  # a full batch: written at once, and held in the sink
            writer.offer(record(s))
        while writer.buffered:
            await asyncio.sleep(0.001)
        writer.offer(record(3))
        writer.offer(record(4))
        sink.resume()
        while writer.written < 3:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.2)  # time for a write of its own, had the drain gone on
        assert sink.batches == [[record(0), record(1), record(2)]] and writer.buffered == 2
        await writer.close()  # closing writes the rest
        assert sink.batches[1:] == [[record(3), record(4)]]
        await task

    run(resuming(sink, scenario()))


def test_a_failing_write_is_counted_and_dropped_and_later_batches_are_written():
    async def scenario():
        sink = MemorySink(fail_writes=1)
        writer = InferenceLogWriter(sink, batch_size=2, flush_interval_s=3600)
        task = asyncio.create_task(writer.run())
        writer.offer(record(0)), writer.offer(record(1))
        while writer.failed < 2:
            await asyncio.sleep(0.001)
        writer.offer(record(2)), writer.offer(record(3))
        while writer.written < 2:
            await asyncio.sleep(0.001)
        assert not task.done()
        assert sink.records == [record(2), record(3)]
        assert (writer.failed, writer.written, writer.dropped) == (2, 2, 0)
        await writer.close()
        await task

    run(scenario())


def test_a_stalled_sink_never_blocks_offer_the_buffer_fills_and_then_drops():
    sink = MemorySink()
    sink.pause()

    async def scenario():
        writer = InferenceLogWriter(sink, max_buffer=4, batch_size=2, flush_interval_s=3600)
        task = asyncio.create_task(writer.run())
        writer.offer(record(0)), writer.offer(record(1))
        while writer.buffered:  # the loop took the batch; its write now hangs in a thread
            await asyncio.sleep(0.001)

        accepted = [writer.offer(record(s)) for s in range(2, 8)]  # on the event loop, while the write hangs

        assert accepted == [True] * 4 + [False] * 2
        assert (writer.buffered, writer.dropped, writer.written) == (4, 2, 0)
        sink.resume()
        await writer.close()
        await task
        assert [r.at for r in sink.records] == [record(s).at for s in range(6)]
        assert (writer.written, writer.dropped, writer.buffered) == (6, 2, 0)

    run(resuming(sink, scenario()))


def test_close_flushes_what_is_buffered_and_refuses_later_offers():
    async def scenario():
        sink = MemorySink()
        writer = InferenceLogWriter(sink, batch_size=2, flush_interval_s=3600)
        task = asyncio.create_task(writer.run())
        await asyncio.sleep(0)
        for s in range(5):
            writer.offer(record(s))
        await writer.close()
        await task
        assert sink.records == [record(s) for s in range(5)]
        assert writer.offer(record(9)) is False and writer.dropped == 1

    run(scenario())


def test_close_gives_up_on_a_sink_that_never_answers_after_its_timeout():
    sink = MemorySink()
    sink.pause()

    async def scenario():
        writer = InferenceLogWriter(sink, batch_size=1, flush_interval_s=3600, close_timeout_s=0.05)
        task = asyncio.create_task(writer.run())
        writer.offer(record(0))
        while writer.buffered:  # the loop took record 0; its write hangs
            await asyncio.sleep(0.001)
        writer.offer(record(1))

        await writer.close()

        assert (writer.dropped, writer.buffered, writer.written) == (1, 0, 0)  # record 1 was waiting behind it
        sink.resume()
        await task
        assert sink.records == [record(0)] and writer.written == 1

    run(resuming(sink, scenario()))


def test_close_before_the_loop_ever_ran_writes_the_buffer_once():
    async def scenario():
        sink = MemorySink(delay_s=0.05)
        writer = InferenceLogWriter(sink, batch_size=2, flush_interval_s=3600)
        task = asyncio.create_task(writer.run())  # scheduled, not started yet
        for s in range(3):
            writer.offer(record(s))
        await writer.close()
        await task
        assert sink.records == [record(0), record(1), record(2)] and writer.written == 3
        assert sink.most_concurrent_writes == 1  # close() and the loop never wrote at the same time

    run(scenario())


def test_the_writer_writes_to_the_database_store(migrated_engine):
    store = InferenceLogStore(migrated_engine)

    async def scenario():
        writer = InferenceLogWriter(store, batch_size=50, flush_interval_s=3600)
        task = asyncio.create_task(writer.run())
        for s in range(120):
            writer.offer(record(s))
        await writer.close()
        await task
        assert writer.written == 120

    run(scenario())
    assert len(store.recent("gec", T0, limit=1000)) == 120


# The helpers the router uses.

def test_sample_logs_none_all_or_about_the_rate():
    class FixedRng:
        def __init__(self, value: float) -> None:
            self.value = value

        def random(self) -> float:
            return self.value

    assert not sample(0.0, FixedRng(0.0))
    assert sample(1.0, FixedRng(0.999))
    assert sample(0.1, FixedRng(0.05)) and not sample(0.1, FixedRng(0.1))


@pytest.mark.parametrize("body, max_bytes, expected", [
    (b"hello", 5, "hello"),
    (b"hello world", 5, "hello…[truncated 6 bytes]"),
    ("añb".encode(), 2, "a…[truncated 3 bytes]"),  # never half of "ñ"
    (b"\xffok", 10, "\ufffdok"),
    (b"", 10, ""),
    (b"hello", 0, None),
])
def test_capped(body, max_bytes, expected):
    assert capped(body, max_bytes) == expected


# The command line.

@pytest.fixture
def cli(sqlite_url, monkeypatch):
    from controlplane.cli import app

    monkeypatch.setenv("MODELPLANE_DATABASE_URL", sqlite_url)
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps tables at the terminal width
    db.upgrade(sqlite_url)
    return lambda *args: CliRunner().invoke(app, ["requests", *args])


def now_record(seconds_ago: float, kind: str = "serve", **extra) -> InferenceRecord:
    return InferenceRecord(at=datetime.now(timezone.utc) - timedelta(seconds=seconds_ago), endpoint="gec",
                           kind=kind, status=200, latency_ms=8.25, request_bytes=31, response_bytes=77, **extra)


def test_requests_prints_recent_records_newest_first(cli, sqlite_url):
    engine = db.make_engine(sqlite_url)
    InferenceLogStore(engine).write([now_record(30, revision_id="gec-v1", token_id="tok-old"),
                                     now_record(5, revision_id="gec-v2", token_id="tok-new", kind="shadow"),
                                     now_record(7200, revision_id="gec-v0")])
    engine.dispose()

    shown = cli("gec", "--since", "10m")

    assert shown.exit_code == 0, shown.output
    assert shown.output.index("gec-v2") < shown.output.index("gec-v1")
    assert "gec-v0" not in shown.output
    assert "tok-new" in shown.output and "8.2" in shown.output and "77" in shown.output
    only_serve = cli("gec", "--kind", "serve")
    assert "gec-v1" in only_serve.output and "gec-v2" not in only_serve.output


def test_requests_exports_to_parquet(cli, sqlite_url, tmp_path):
    engine = db.make_engine(sqlite_url)
    InferenceLogStore(engine).write([now_record(s) for s in (1, 2, 3)])
    engine.dispose()
    path = tmp_path / "out.parquet"

    shown = cli("gec", "--since", "1h", "--export", str(path))

    assert shown.exit_code == 0, shown.output
    assert "wrote 3 record(s)" in shown.output and str(path) in shown.output
    assert pq.read_table(path).num_rows == 3


@pytest.mark.parametrize("args, message", [
    (["--since", "yesterday"], "--since must be"),
    (["--kind", "replay"], "--kind must be one of serve, canary, shadow"),
])
def test_requests_refuses_bad_options_with_exit_code_2(cli, args, message):
    shown = cli("gec", *args)
    assert shown.exit_code == 2
    assert message in shown.output and "Traceback" not in shown.output


def test_requests_to_an_unknown_endpoint_with_no_records_says_so(cli):
    shown = cli("nope")
    assert shown.exit_code == 1
    assert "no endpoint named 'nope'" in shown.output
