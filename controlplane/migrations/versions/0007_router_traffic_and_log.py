"""The router's traffic and its log: a canary split and a shadow copy per endpoint (columns of
``traffic``), and the inference log, the sampled requests and responses the router wrote.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-08
"""
import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("traffic") as batch:
        batch.add_column(sa.Column("canary_revision_id", sa.String(96), nullable=True))
        batch.add_column(sa.Column("canary_percent", sa.Float(), nullable=True))
        batch.add_column(sa.Column("shadow_revision_id", sa.String(96), nullable=True))
        batch.add_column(sa.Column("shadow_percent", sa.Float(), nullable=True))
    op.create_table(
        "inference_log",
        # SQLite only autoincrements an INTEGER PRIMARY KEY, not a BIGINT one.
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("endpoint", sa.String(63), nullable=False),
        sa.Column("revision_id", sa.String(96), nullable=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("token_id", sa.String(64), nullable=True),
        sa.Column("router_id", sa.String(255), nullable=True),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("latency_ms", sa.Float(), nullable=False),
        sa.Column("request_bytes", sa.Integer(), nullable=False),
        sa.Column("response_bytes", sa.Integer(), nullable=False),
        sa.Column("request_payload", sa.Text(), nullable=True),
        sa.Column("response_payload", sa.Text(), nullable=True),
    )
    op.create_index("ix_inference_log_endpoint_at", "inference_log", ["endpoint", "at"])


def downgrade() -> None:
    op.drop_index("ix_inference_log_endpoint_at", table_name="inference_log")
    op.drop_table("inference_log")
    with op.batch_alter_table("traffic") as batch:
        batch.drop_column("shadow_percent")
        batch.drop_column("shadow_revision_id")
        batch.drop_column("canary_percent")
        batch.drop_column("canary_revision_id")
