"""Broker URL helpers."""

from __future__ import annotations


def redact_url(url: str) -> str:
    """The URL without its password, for error messages and logs."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{host}"
