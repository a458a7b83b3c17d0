"""The errors memplan reports to users: one paragraph naming the cause and the fix."""

from __future__ import annotations

class MemplanError(Exception):
    """A user-facing failure: the message is one paragraph naming the cause and the fix."""


class ConfigError(MemplanError):
    """`pipeline.toml` cannot be read or does not match the schema."""
