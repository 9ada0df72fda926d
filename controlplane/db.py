"""Database engine and schema migrations for the control plane.

SQLite (WAL mode) under ``MODELPLANE_HOME`` by default; PostgreSQL when
``MODELPLANE_DATABASE_URL`` says so. The schema only ever changes through Alembic.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

# libpq connection parameters (psycopg passes them through) that bound how long a client waits
# on a PostgreSQL server that cannot be reached, so a caller gets an error within seconds, not
# after the operating system's TCP timeouts (minutes; psycopg's own connect default is 130 s):
POSTGRES_TIMEOUTS = {
    "connect_timeout": 5,  # s: to open a connection (refused: at once; no answer: after 5 s)
    "keepalives": 1,  # probe an idle connection (one waiting for an answer is idle too) ...
    "keepalives_idle": 5,  # s: ... after 5 s of silence,
    "keepalives_interval": 2,  # s: every 2 s,
    "keepalives_count": 3,  # and drop it after 3 unanswered probes: a dead server in about 11 s
    "tcp_user_timeout": 10_000,  # ms: drop a connection whose sent data goes unacknowledged for 10 s
}
LIBPQ_DRIVERS = ("psycopg", "psycopg2")  # the drivers that hand these parameters to libpq


def make_engine(database_url: str) -> Engine:
    """An engine for ``database_url``; SQLite gets WAL, foreign keys and a busy timeout;
    PostgreSQL gets bounded connect and dead-connection timeouts (:data:`POSTGRES_TIMEOUTS`) and a
    ping before a pooled connection is reused, so an unreachable server is an error within seconds.

    WAL lets the admin API write the webhook inbox while the Dagster sensor reads it;
    the 30 s busy timeout covers the short writer-writer overlaps that remain.
    """
    if database_url.startswith("sqlite"):
        path = database_url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(database_url, connect_args={"timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    return create_engine(database_url, pool_pre_ping=True, connect_args=postgres_connect_args(database_url))


def postgres_connect_args(database_url: str) -> dict:
    """:data:`POSTGRES_TIMEOUTS`, less any the URL sets itself (``?connect_timeout=10`` wins);
    none for a driver that does not use libpq.

    The keepalives only ever drop a connection whose server stopped answering: a slow query on a
    live server keeps its connection, since the server's kernel answers the probes.

    >>> "connect_timeout" in postgres_connect_args("postgresql+psycopg://u@db/modelplane?connect_timeout=20")
    False
    >>> postgres_connect_args("postgresql+psycopg://u@db/modelplane")["tcp_user_timeout"]
    10000
    >>> postgres_connect_args("postgresql+pg8000://u@db/modelplane")
    {}
    """
    url = make_url(database_url)
    if url.get_driver_name() not in LIBPQ_DRIVERS:
        return {}
    return {name: value for name, value in POSTGRES_TIMEOUTS.items() if name not in url.query}


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    """Bring the schema at ``database_url`` up to ``revision`` (idempotent)."""
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)
