"""Revisions, traffic, local replicas and bearer tokens.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""
import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "revisions",
        sa.Column("id", sa.String(96), primary_key=True),
        sa.Column("endpoint", sa.String(63), nullable=False),
        sa.Column("partition_key", sa.String(255), nullable=False),
        sa.Column("model_dir", sa.Text(), nullable=False),
        sa.Column("runtime", sa.String(16), nullable=False),
        sa.Column("runtime_config", sa.JSON(), nullable=False),
        sa.Column("desired_replicas", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_revisions_endpoint", "revisions", ["endpoint"])
    op.create_index("ix_revisions_state", "revisions", ["state"])
    op.create_table(
        "traffic",
        sa.Column("endpoint", sa.String(63), primary_key=True),
        sa.Column("revision_id", sa.String(96), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "replicas",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("revision_id", sa.String(96), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("port", sa.Integer(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("restarts", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_replicas_revision_id", "replicas", ["revision_id"])
    op.create_table(
        "tokens",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("token_sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("endpoints", sa.JSON(), nullable=False),
        sa.Column("admin", sa.Boolean(), nullable=False),
        sa.Column("description", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("tokens")
    op.drop_index("ix_replicas_revision_id", table_name="replicas")
    op.drop_table("replicas")
    op.drop_table("traffic")
    op.drop_index("ix_revisions_state", table_name="revisions")
    op.drop_index("ix_revisions_endpoint", table_name="revisions")
    op.drop_table("revisions")
