"""Broker URL helpers."""

from __future__ import annotations


def redact_url(url: str) -> str:
    """The URL without its password, for error messages and logs (each of a comma-separated list)."""
    if "," in url:
        return ",".join(redact_url(part.strip()) for part in url.split(","))
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{host}"
