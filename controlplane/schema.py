"""The control-plane tables. Changes here need a migration in ``migrations/versions``."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, DateTime, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class EndpointRow(Base):
    """A validated endpoint spec (``controlplane.specs.EndpointSpec``) stored as JSON."""

    __tablename__ = "endpoints"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    registered_model: Mapped[str] = mapped_column(String(255), index=True)
    alias: Mapped[str] = mapped_column(String(255))
    spec: Mapped[dict] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class WebhookInboxRow(Base):
    """One verified MLflow webhook delivery, waiting for the registry sensor.

    The delivery id is the primary key, so a replayed delivery cannot be stored twice.
    """

    __tablename__ = "webhook_inbox"

    delivery_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    event: Mapped[str] = mapped_column(String(64))
    registered_model: Mapped[str] = mapped_column(String(255), index=True)
    payload: Mapped[str] = mapped_column(Text)
    received_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    processed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True, index=True)
