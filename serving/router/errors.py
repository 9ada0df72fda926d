"""The router's one error type: an HTTP status and a message a person can act on."""

from __future__ import annotations


class RouterError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
