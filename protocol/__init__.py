"""The pure core of parkway: messages, identities and phase machines. No I/O lives here."""

SCHEMA_VERSION = 1
