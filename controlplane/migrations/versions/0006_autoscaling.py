"""Autoscaling: the decisions the controller took, its leader lease, each endpoint's demand per
minute (the predictive floor's history), where each router answers, and which replicas of a
revision a scale-down named to stop first.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""
import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("routers") as batch:
        batch.add_column(sa.Column("url", sa.String(255), nullable=True))
    with op.batch_alter_table("revisions") as batch:
        batch.add_column(sa.Column("retiring", sa.JSON(), nullable=True))
    op.create_table(
        "scaling_decisions",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("endpoint", sa.String(63), nullable=False, index=True),
        sa.Column("revision_id", sa.String(255), nullable=False),
        sa.Column("axis", sa.String(16), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("replicas", sa.Integer(), nullable=True),
        sa.Column("target", sa.Float(), nullable=True),
        sa.Column("rule", sa.String(32), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("inputs", sa.JSON(), nullable=False),
    )
    op.create_table(
        "demand_minutes",
        sa.Column("endpoint", sa.String(63), primary_key=True),
        sa.Column("minute", sa.BigInteger(), primary_key=True),
        sa.Column("peak_in_flight", sa.Float(), nullable=False),
    )
    op.create_table(
        "leases",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("holder", sa.String(255), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("leases")
    op.drop_table("demand_minutes")
    op.drop_table("scaling_decisions")
    with op.batch_alter_table("revisions") as batch:
        batch.drop_column("retiring")
    with op.batch_alter_table("routers") as batch:
        batch.drop_column("url")
