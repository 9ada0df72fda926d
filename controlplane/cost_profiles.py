"""Cost profiles in the control plane: one fitted cost model per (model version, hardware profile).

The ``cost_model`` asset writes them; the router reads the profile of each endpoint's
serving revision for the hardware it runs on, and the autoscaler takes its starting
``target_concurrency`` from the same row. A profile measured on other hardware is never
returned: :meth:`CostProfileStore.get` matches the hardware key exactly, and a missing
profile means "benchmark it", not "guess".
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from controlplane.schema import CostProfileRow
from controlplane.store import Clock, utc_now


@dataclass(frozen=True)
class CostProfile:
    partition_key: str  # "<model>.v<version>"
    hardware_profile: str  # cluster.hardware.HardwareProfile.key
    model: dict  # costmodel.fit.CostModel.to_json()
    target_concurrency: int
    reason: str
    created_at: datetime


class CostProfileStore:
    def __init__(self, engine: Engine, now: Clock = utc_now) -> None:
        self._engine = engine
        self._now = now

    def put(self, partition_key: str, hardware_profile: str, model: dict, target_concurrency: int,
            reason: str) -> CostProfile:
        """Store (or replace) the profile of a version on one hardware profile, in one transaction."""
        with Session(self._engine) as session, session.begin():
            row = session.get(CostProfileRow, (partition_key, hardware_profile))
            if row is None:
                row = CostProfileRow(partition_key=partition_key, hardware_profile=hardware_profile)
                session.add(row)
            row.model, row.target_concurrency, row.reason = model, target_concurrency, reason
            row.created_at = self._now()
            return _profile(row)

    def get(self, partition_key: str, hardware_profile: str) -> CostProfile | None:
        with Session(self._engine) as session:
            row = session.get(CostProfileRow, (partition_key, hardware_profile))
            return _profile(row) if row else None

    def newest(self, partition_key: str) -> CostProfile | None:
        """The version's most recently measured profile, on whatever hardware it was measured."""
        with Session(self._engine) as session:
            row = session.scalars(select(CostProfileRow).where(CostProfileRow.partition_key == partition_key)
                                  .order_by(CostProfileRow.created_at.desc()).limit(1)).first()
            return _profile(row) if row else None

    def for_hardware(self, hardware_profile: str) -> dict[str, CostProfile]:
        """Every version's profile on ``hardware_profile``, by partition key (the router's read)."""
        with Session(self._engine) as session:
            rows = session.scalars(select(CostProfileRow).where(CostProfileRow.hardware_profile == hardware_profile))
            return {row.partition_key: _profile(row) for row in rows}


def _profile(row: CostProfileRow) -> CostProfile:
    return CostProfile(row.partition_key, row.hardware_profile, dict(row.model), row.target_concurrency, row.reason,
                       row.created_at)
