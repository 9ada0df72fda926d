"""Endpoint specs and the MLflow webhook inbox.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "endpoints",
        sa.Column("name", sa.String(63), primary_key=True),
        sa.Column("registered_model", sa.String(255), nullable=False),
        sa.Column("alias", sa.String(255), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_endpoints_registered_model", "endpoints", ["registered_model"])
    op.create_table(
        "webhook_inbox",
        sa.Column("delivery_id", sa.String(64), primary_key=True),
        sa.Column("event", sa.String(64), nullable=False),
        sa.Column("registered_model", sa.String(255), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("processed_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_webhook_inbox_registered_model", "webhook_inbox", ["registered_model"])
    op.create_index("ix_webhook_inbox_processed_at", "webhook_inbox", ["processed_at"])


def downgrade() -> None:
    op.drop_index("ix_webhook_inbox_processed_at", table_name="webhook_inbox")
    op.drop_index("ix_webhook_inbox_registered_model", table_name="webhook_inbox")
    op.drop_table("webhook_inbox")
    op.drop_index("ix_endpoints_registered_model", table_name="endpoints")
    op.drop_table("endpoints")
