"""Bearer tokens: created once, stored only as a SHA-256, scoped to endpoints.

A token reads ``mp_<id>_<secret>``: the id names it in listings and revocations, the secret
makes it unguessable (192 random bits). A token with ``admin`` may call the admin API and
every endpoint; otherwise it may call exactly the endpoints it was created for.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from controlplane.schema import TokenRow
from controlplane.store import Clock, utc_now

PREFIX = "mp_"


@dataclass(frozen=True)
class Grant:
    token_id: str
    endpoints: frozenset[str]
    admin: bool

    def allows(self, endpoint: str) -> bool:
        return self.admin or endpoint in self.endpoints


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenStore:
    def __init__(self, engine: Engine, now: Clock = utc_now) -> None:
        self._engine = engine
        self._now = now

    def create(self, endpoints: list[str], admin: bool = False, description: str | None = None) -> tuple[str, str]:
        """Store a new token; returns (token id, the token). The token is not kept anywhere."""
        if not endpoints and not admin:
            raise ValueError("a token needs at least one endpoint, or the admin scope")
        token_id = secrets.token_hex(4)
        token = f"{PREFIX}{token_id}_{secrets.token_urlsafe(24)}"
        with Session(self._engine) as session, session.begin():
            session.add(TokenRow(id=token_id, token_sha256=token_sha256(token), endpoints=sorted(set(endpoints)),
                                 admin=admin, description=description, created_at=self._now()))
        return token_id, token

    def grants(self) -> dict[str, Grant]:
        """Every live token as {sha256: Grant}: what the router caches and refreshes."""
        with Session(self._engine) as session:
            rows = session.scalars(select(TokenRow).where(TokenRow.revoked_at.is_(None)))
            return {r.token_sha256: Grant(r.id, frozenset(r.endpoints), r.admin) for r in rows}

    def verify(self, token: str) -> Grant | None:
        return self.grants().get(token_sha256(token))

    def list(self) -> list[dict]:
        with Session(self._engine) as session:
            rows = session.scalars(select(TokenRow).order_by(TokenRow.created_at))
            return [{"id": r.id, "endpoints": r.endpoints, "admin": r.admin, "description": r.description,
                     "created_at": r.created_at, "revoked": r.revoked_at is not None} for r in rows]

    def revoke(self, token_id: str) -> bool:
        with Session(self._engine) as session, session.begin():
            row = session.get(TokenRow, token_id)
            if row is None or row.revoked_at is not None:
                return False
            row.revoked_at = self._now()
            return True
