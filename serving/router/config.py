"""The router's typed configuration; defaults live here and nowhere else."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator


class RouterConfig(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535, description="Port clients call.")
    max_body_bytes: int = Field(1 << 20, gt=0, description="Largest request body accepted (413 above), bytes.")
    refresh_interval_s: float = Field(0.5, gt=0, description="How often discovery re-reads replicas, tokens, specs.")
    connect_timeout_s: float = Field(2.0, gt=0, description="TCP connect to a replica.")
    request_timeout_s: float = Field(300.0, gt=0, description="Whole upstream request, first byte to last.")
    max_attempts: int = Field(3, ge=1, description="Tries per request over distinct replicas (connect failures only).")
    retry_after_s: int = Field(5, ge=1, description="Retry-After sent with 503 when no replica is ready.")

    @model_validator(mode="after")
    def _timeouts_ordered(self) -> "RouterConfig":
        if self.connect_timeout_s > self.request_timeout_s:
            raise ValueError("connect_timeout_s must not exceed request_timeout_s")
        return self
