"""Cost profiles: the fitted cost model of one model version on one hardware profile.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "cost_profiles",
        sa.Column("partition_key", sa.String(255), primary_key=True),
        sa.Column("hardware_profile", sa.String(255), primary_key=True),
        sa.Column("model", sa.JSON(), nullable=False),
        sa.Column("target_concurrency", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("cost_profiles")
