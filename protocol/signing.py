"""Per-role Ed25519 signatures over a message and every routing fact a receiver acts on.

Each role of a run (``protocol.ids.Role``) has its own key pair. A process holds the private key of its
own role only, plus the public key of every role; a peer cannot sign as another role. The signed input
binds a version tag, the run, the sender address, the role of the signing key, the destination address,
the message type, the correlation id, a message id, the content type and the exact body bytes, so a
message cannot be replayed into another run, moved to another queue, re-attributed to another sender or
re-typed. Each field is length-prefixed, so no two different field lists sign the same bytes.

In one address space (the embedded demo, unit tests) a ``Keyring`` is derived from a shared secret: it
holds every role's private key, which is no protection against a peer, only against other runs.

Text forms (environment variables): a private key is ``ROLE:BASE64`` (the 32-byte raw seed), several
are joined by commas; the public table is ``ROLE:BASE64,ROLE:BASE64,...`` (the 32-byte raw keys).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from parkway.protocol.ids import Role

SIGNATURE_HEADER = "x-parkway-signature"
SENDER_HEADER = "x-parkway-sender"
RUN_HEADER = "x-parkway-run"
KEY_HEADER = "x-parkway-key"  # the role whose key signed
TO_HEADER = "x-parkway-to"  # the destination address the sender meant
TYPE_HEADER = "x-parkway-type"  # the message type, checked against the decoded body
MESSAGE_ID_HEADER = "x-parkway-message-id"

VERSION = "parkway-v2"
ROLES: tuple[str, ...] = tuple(role.value for role in Role)


class KeyFormatError(ValueError):
    """A key or public key table in its text form does not parse; the message says which and why."""


def signing_input(
    *,
    run: str,
    sender: str,
    key_role: str,
    to: str,
    message_type: str,
    correlation_id: str,
    message_id: str,
    content_type: str,
    body: bytes,
) -> bytes:
    fields = (VERSION, run, sender, key_role, to, message_type, correlation_id, message_id, content_type)
    parts = [part.encode() for part in fields] + [body]
    return b"".join(len(part).to_bytes(8, "big") + part for part in parts)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _unb64(text: str, what: str) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise KeyFormatError(f"{what}: not base64") from None
    if len(raw) != 32:
        raise KeyFormatError(f"{what}: want 32 bytes, got {len(raw)}")
    return raw


def _entries(text: str, what: str) -> list[tuple[str, str]]:
    entries = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        role, sep, value = item.partition(":")
        if not sep or role not in ROLES:
            raise KeyFormatError(
                f"{what}: entry {item[:24]!r}... is not ROLE:BASE64 with ROLE one of {ROLES}"
            )
        entries.append((role, value))
    if not entries:
        raise KeyFormatError(f"{what}: empty")
    return entries


@dataclass(frozen=True)
class Keyring:
    """The private keys this process may sign with and the public key of every role."""

    private: Mapping[str, Ed25519PrivateKey] = field(default_factory=dict)
    public: Mapping[str, Ed25519PublicKey] = field(default_factory=dict)

    # -- making one --------------------------------------------------------------------------------
    @classmethod
    def generate(cls, roles: Iterable[str] = ROLES) -> Keyring:
        private = {role: Ed25519PrivateKey.generate() for role in roles}
        return cls(private, {role: key.public_key() for role, key in private.items()})

    @classmethod
    def derive(cls, secret: bytes, run: str) -> Keyring:
        """Every role's key pair from ``secret`` and the run: for one address space, or for a launcher
        that hands each process it starts only its own role's private key."""
        private = {
            role: Ed25519PrivateKey.from_private_bytes(
                hashlib.sha256(b"\0".join((VERSION.encode(), run.encode(), role.encode(), secret))).digest()
            )
            for role in ROLES
        }
        return cls(private, {role: key.public_key() for role, key in private.items()})

    @classmethod
    def from_text(cls, private_text: str, public_text: str) -> Keyring:
        """A process's keyring from ``PARKWAY_SIGNING_KEY`` and ``PARKWAY_PUBLIC_KEYS`` text. Each
        private key must belong to the role the table names it under."""
        public = {
            role: Ed25519PublicKey.from_public_bytes(_unb64(value, f"public key of {role}"))
            for role, value in _entries(public_text, "public key table")
        }
        private = {}
        for role, value in _entries(private_text, "signing key") if private_text.strip() else []:
            key = Ed25519PrivateKey.from_private_bytes(_unb64(value, f"signing key of {role}"))
            if role not in public or public[role].public_bytes_raw() != key.public_key().public_bytes_raw():
                raise KeyFormatError(
                    f"the signing key of {role} does not match the public key table's entry for {role}"
                )
            private[role] = key
        return cls(private, public)

    def only(self, roles: Iterable[str]) -> Keyring:
        """The same public table with the private keys of ``roles`` only."""
        chosen = set(roles)
        return Keyring({r: k for r, k in self.private.items() if r in chosen}, self.public)

    # -- text forms --------------------------------------------------------------------------------
    def private_text(self, roles: Iterable[str] | None = None) -> str:
        chosen = list(self.private) if roles is None else list(roles)
        return ",".join(f"{role}:{_b64(self.private[role].private_bytes_raw())}" for role in chosen)

    def public_text(self) -> str:
        return ",".join(f"{role}:{_b64(key.public_bytes_raw())}" for role, key in self.public.items())

    # -- signing and checking ----------------------------------------------------------------------
    def sign(self, key_role: str, data: bytes) -> str:
        key = self.private.get(key_role)
        if key is None:
            raise KeyError(f"this process holds no signing key for role {key_role!r}")
        return _b64(key.sign(data))

    def verify(self, key_role: str, data: bytes, signature: str | None) -> bool:
        key = self.public.get(key_role)
        if key is None or not signature:
            return False
        try:
            raw = base64.b64decode(signature, validate=True)
            key.verify(raw, data)
        except (binascii.Error, ValueError, InvalidSignature):
            return False
        return True
