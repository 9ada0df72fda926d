"""Reading and writing control-plane rows: endpoint specs and the webhook inbox.

Both stores take an injected clock (``now``) so tests can fix time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from pydantic import ValidationError
from sqlalchemy import Engine, delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.schema import EndpointRow, RevisionRow, TokenRow, TrafficRow, WebhookInboxRow
from controlplane.specs import EndpointSpec, SpecError, format_validation_error

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


class EndpointStore:
    def __init__(self, engine: Engine, now: Clock = utc_now) -> None:
        self._engine = engine
        self._now = now

    def put(self, spec: EndpointSpec) -> bool:
        """Create or replace the spec named ``spec.name``; True when it was new."""
        now = self._now()
        with Session(self._engine) as session, session.begin():
            row = session.get(EndpointRow, spec.name)
            created = row is None
            if created:
                row = EndpointRow(name=spec.name, created_at=now)
                session.add(row)
            row.registered_model = spec.registered_model
            row.alias = spec.alias
            row.spec = spec.model_dump(mode="json")
            row.updated_at = now
        return created

    def get(self, name: str) -> EndpointSpec | None:
        with Session(self._engine) as session:
            row = session.get(EndpointRow, name)
            if row is None:
                return None
            try:
                return EndpointSpec.model_validate(row.spec)
            except ValidationError as exc:
                raise SpecError(f"the stored spec of {name!r} no longer validates: {format_validation_error(exc)}; "
                                "store a corrected one with `modelplane endpoints create -f`") from None

    def list(self) -> list[EndpointSpec]:
        """Every stored spec that validates; one that no longer does is left out (see :meth:`invalid`),
        so it never stops the sensors for every other endpoint."""
        return [spec for spec in self._load() if isinstance(spec, EndpointSpec)]

    def invalid(self) -> list[tuple[str, str]]:
        """(name, why) of stored specs that no longer validate, e.g. written under looser rules."""
        return [item for item in self._load() if not isinstance(item, EndpointSpec)]

    def _load(self) -> list:
        with Session(self._engine) as session:
            rows = session.scalars(select(EndpointRow).order_by(EndpointRow.name))
            loaded = []
            for row in rows:
                try:
                    loaded.append(EndpointSpec.model_validate(row.spec))
                except ValidationError as exc:
                    loaded.append((row.name, format_validation_error(exc)))
            return loaded

    def delete(self, name: str) -> bool:
        """Remove the spec and, in the same transaction, everything that made the endpoint live.

        Its traffic row goes, its revisions are retired (the cluster backend stops their
        replicas), tokens scoped to it alone are revoked and the others lose it from their
        scope, so a new endpoint of the same name starts clean. True when it existed.
        """
        now = self._now()
        with Session(self._engine) as session, session.begin():
            row = session.get(EndpointRow, name)
            if row is None:
                return False
            session.delete(row)
            session.execute(delete(TrafficRow).where(TrafficRow.endpoint == name))
            session.execute(update(RevisionRow).where(RevisionRow.endpoint == name,
                                                      RevisionRow.state.not_in(("retired", "failed")))
                            .values(state="retired", desired_replicas=0, updated_at=now))
            for token in session.scalars(select(TokenRow).where(TokenRow.revoked_at.is_(None))):
                if name in token.endpoints:
                    remaining = [endpoint for endpoint in token.endpoints if endpoint != name]
                    token.endpoints = remaining
                    if not remaining and not token.admin:
                        token.revoked_at = now
            return True


@dataclass(frozen=True)
class InboxItem:
    delivery_id: str
    event: str
    registered_model: str
    payload: str
    received_at: datetime


class WebhookInbox:
    """Verified webhook deliveries, stored once each and drained by the registry sensor."""

    def __init__(self, engine: Engine, now: Clock = utc_now) -> None:
        self._engine = engine
        self._now = now

    def add(self, delivery_id: str, event: str, registered_model: str, payload: str) -> bool:
        """Store a delivery; False (and nothing written) when the delivery id was seen before."""
        try:
            with Session(self._engine) as session, session.begin():
                session.add(
                    WebhookInboxRow(
                        delivery_id=delivery_id,
                        event=event,
                        registered_model=registered_model,
                        payload=payload,
                        received_at=self._now(),
                    )
                )
        except IntegrityError:
            return False
        return True

    def contains(self, delivery_id: str) -> bool:
        with Session(self._engine) as session:
            return session.get(WebhookInboxRow, delivery_id) is not None

    def pending(self, limit: int = 500) -> list[InboxItem]:
        with Session(self._engine) as session:
            rows = session.scalars(
                select(WebhookInboxRow)
                .where(WebhookInboxRow.processed_at.is_(None))
                .order_by(WebhookInboxRow.received_at)
                .limit(limit)
            )
            return [
                InboxItem(r.delivery_id, r.event, r.registered_model, r.payload, r.received_at) for r in rows
            ]

    def mark_processed(self, delivery_ids: list[str]) -> None:
        if not delivery_ids:
            return
        with Session(self._engine) as session, session.begin():
            session.execute(
                update(WebhookInboxRow)
                .where(WebhookInboxRow.delivery_id.in_(delivery_ids))
                .values(processed_at=self._now())
            )
