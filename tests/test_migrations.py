"""The control-plane schema only changes through Alembic, on SQLite and PostgreSQL alike."""

from sqlalchemy import inspect

from controlplane import db
from controlplane.schema import Base


def tables(url: str) -> set[str]:
    engine = db.make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_creates_every_table_of_the_schema_and_downgrade_removes_them(database_url):
    db.upgrade(database_url)
    assert tables(database_url) == set(Base.metadata.tables)
    db.upgrade(database_url)  # idempotent
    db.downgrade(database_url, "base")
    assert tables(database_url) == set()
    db.upgrade(database_url)
    assert tables(database_url) == set(Base.metadata.tables)


def test_migrated_columns_match_the_orm_models(database_url):
    db.upgrade(database_url)
    engine = db.make_engine(database_url)
    inspector = inspect(engine)
    for name, table in Base.metadata.tables.items():
        assert {c["name"] for c in inspector.get_columns(name)} == {c.name for c in table.columns}, name
    engine.dispose()


def test_sqlite_runs_in_wal_mode(sqlite_url):
    db.upgrade(sqlite_url)
    engine = db.make_engine(sqlite_url)
    with engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    engine.dispose()
