"""Database engine and schema migrations for the control plane.

SQLite (WAL mode) under ``MODELPLANE_HOME`` by default; PostgreSQL when
``MODELPLANE_DATABASE_URL`` says so. The schema only ever changes through Alembic.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def make_engine(database_url: str) -> Engine:
    """An engine for ``database_url``; SQLite gets WAL, foreign keys and a busy timeout.

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
    return create_engine(database_url, pool_pre_ping=True)


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
