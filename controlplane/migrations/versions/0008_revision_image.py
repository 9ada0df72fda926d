"""What a revision's replicas start from: the serving image and its seekable form (JSON), or
null for replicas that read the model directory and the runtime environment in place.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""
import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("revisions") as batch:
        batch.add_column(sa.Column("image", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("revisions") as batch:
        batch.drop_column("image")
