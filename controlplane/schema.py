"""The control-plane tables. Changes here need a migration in ``migrations/versions``."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, Index, Integer, String, Text
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


class RevisionRow(Base):
    """One model version rolled out for one endpoint, and how many replicas it should have.

    ``state``: pending → ready (replicas answer) → serving (takes traffic) → draining →
    retired; or failed.
    """

    __tablename__ = "revisions"

    id: Mapped[str] = mapped_column(String(96), primary_key=True)
    endpoint: Mapped[str] = mapped_column(String(63), index=True)
    partition_key: Mapped[str] = mapped_column(String(255))
    model_dir: Mapped[str] = mapped_column(Text)
    runtime: Mapped[str] = mapped_column(String(16))
    runtime_config: Mapped[dict] = mapped_column(JSON)
    # What it serves and why: checkpoint label, eval gate verdict and reasons, hardware profile, AMX state.
    details: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    # The serving image its replicas start from (images.source_ref.ImageRef as JSON); null: in place.
    image: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    desired_replicas: Mapped[int] = mapped_column(Integer)
    # Replica ids the last scale-down named to stop first (``Cluster.scale``'s victims), in order.
    retiring: Mapped[list | None] = mapped_column(JSON, nullable=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class TrafficRow(Base):
    """Which revision of an endpoint takes its traffic; optionally a canary taking a share of it,
    and a shadow revision that gets a copy of a share of it (its answers are logged, never returned)."""

    __tablename__ = "traffic"

    endpoint: Mapped[str] = mapped_column(String(63), primary_key=True)
    revision_id: Mapped[str] = mapped_column(String(96))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    canary_revision_id: Mapped[str | None] = mapped_column(String(96), nullable=True)
    canary_percent: Mapped[float | None] = mapped_column(Float, nullable=True)  # 0–100 of requests
    shadow_revision_id: Mapped[str | None] = mapped_column(String(96), nullable=True)
    shadow_percent: Mapped[float | None] = mapped_column(Float, nullable=True)  # 0–100 of requests copied


class ReplicaRow(Base):
    """One replica process of the local cluster backend, as its supervisor last saw it."""

    __tablename__ = "replicas"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    revision_id: Mapped[str] = mapped_column(String(96), index=True)
    host: Mapped[str] = mapped_column(String(255))
    port: Mapped[int] = mapped_column(Integer)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    state: Mapped[str] = mapped_column(String(16))  # starting | ready | unhealthy | stopped
    restarts: Mapped[int] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class RouterRow(Base):
    """One router process and the routing table it serves: read from the database at ``table_read_at``."""

    __tablename__ = "routers"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)  # host:port:pid
    table_read_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    url: Mapped[str | None] = mapped_column(String(255), nullable=True)  # where its internal routes answer


class TokenRow(Base):
    """A bearer token. Only its SHA-256 is stored; the token itself is shown once."""

    __tablename__ = "tokens"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    endpoints: Mapped[list] = mapped_column(JSON)  # endpoint names this token may call
    admin: Mapped[bool] = mapped_column(Boolean)
    description: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class CostProfileRow(Base):
    """The fitted cost model of a model version (partition key) on one hardware profile.

    Written by the ``cost_model`` asset; read by the router (model units per request) and
    the autoscaler (starting target concurrency). A profile is never used on other hardware.
    """

    __tablename__ = "cost_profiles"

    partition_key: Mapped[str] = mapped_column(String(255), primary_key=True)
    hardware_profile: Mapped[str] = mapped_column(String(255), primary_key=True)
    model: Mapped[dict] = mapped_column(JSON)  # costmodel.fit.CostModel.to_json()
    target_concurrency: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(Text)  # why it was measured: "new version", "drift: …"
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class ScalingDecisionRow(Base):
    """One decision of the autoscaler: on which axis, what it set, and why (rule, reason, inputs)."""

    __tablename__ = "scaling_decisions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    endpoint: Mapped[str] = mapped_column(String(63), index=True)
    revision_id: Mapped[str] = mapped_column(String(255))
    axis: Mapped[str] = mapped_column(String(16))  # horizontal | vertical
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    replicas: Mapped[int | None] = mapped_column(Integer, nullable=True)
    target: Mapped[float | None] = mapped_column(Float, nullable=True)
    rule: Mapped[str] = mapped_column(String(32))
    reason: Mapped[str] = mapped_column(Text)
    inputs: Mapped[dict] = mapped_column(JSON)


class LeaseRow(Base):
    """A named lease: one holder at a time (the autoscaler's leader election)."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(255))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class DemandMinuteRow(Base):
    """An endpoint's peak in-flight work in one wall-clock minute (UNIX seconds // 60)."""

    __tablename__ = "demand_minutes"

    endpoint: Mapped[str] = mapped_column(String(63), primary_key=True)
    minute: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    peak_in_flight: Mapped[float] = mapped_column(Float)


class InferenceLogRow(Base):
    """One sampled request through the router and its answer (``controlplane.inference_log``).

    ``kind``: ``serve`` (the answer the caller got), ``canary`` (the same, from a split's canary
    revision) or ``shadow`` (a shadow revision's answer to a copy of the request). Payloads are
    cut at the router's size cap; either may be absent.
    """

    __tablename__ = "inference_log"
    __table_args__ = (Index("ix_inference_log_endpoint_at", "endpoint", "at"),)

    # SQLite only autoincrements an INTEGER PRIMARY KEY, not a BIGINT one.
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    endpoint: Mapped[str] = mapped_column(String(63))
    revision_id: Mapped[str | None] = mapped_column(String(96), nullable=True)
    kind: Mapped[str] = mapped_column(String(16))  # serve | canary | shadow
    token_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    router_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    status: Mapped[int] = mapped_column(Integer)
    latency_ms: Mapped[float] = mapped_column(Float)
    request_bytes: Mapped[int] = mapped_column(Integer)
    response_bytes: Mapped[int] = mapped_column(Integer)
    request_payload: Mapped[str | None] = mapped_column(Text, nullable=True)
    response_payload: Mapped[str | None] = mapped_column(Text, nullable=True)
