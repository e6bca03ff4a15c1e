"""Process settings that come from the environment: the run, its keys, the broker URL.

Credentials never come from code: the broker URL (with its password) comes from ``PARKWAY_BROKER_URL``
(a command-line flag may override it), the keys from ``PARKWAY_SIGNING_KEY`` (this process's own role's
private key, or several comma-separated where one process hosts several roles) and
``PARKWAY_PUBLIC_KEYS`` (every role's public key); ``parkway keys generate --env`` makes them. Without
them, ``PARKWAY_SECRET`` derives every role's key pair (``Keyring.derive``): an operator's secret, good
for tools and drivers, but a process holding it can sign as any role, so ``parkway actor`` refuses it
unless ``PARKWAY_INSECURE_SHARED_SECRET=1`` says so on purpose (docs/security.md).
``PARKWAY_METRICS_PORT`` (or ``--metrics-port``) serves the process's Prometheus metrics on that port;
0 or unset serves none. ``PARKWAY_MAX_BODY_BYTES`` sets the largest message body accepted and sent
(16 MiB by default). ``PARKWAY_CLUSTER_WAIT_S`` is how long a controller waits for every participant
to answer before its run starts (120 s by default; compose starts the services in any order).
``PARKWAY_REPLY_JOURNAL_MAX_BYTES`` and ``PARKWAY_REPLY_MAX_AGE_S`` bound the reply journal
(``runtime/replies.py``); ``PARKWAY_TRACEMALLOC`` starts tracing allocations at boot (``runtime/memory.py``).
``PARKWAY_NICE`` (or ``parkway actor --nice``) lowers a service process's CPU priority at boot: for the
roles off a snapshot's window, so that on a shared host the window's hops are scheduled first.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from parkway.protocol import codec
from parkway.protocol.ids import validate_name
from parkway.protocol.phases import DEFAULT_MAX_LEASE_S
from parkway.protocol.signing import KeyFormatError, Keyring

DEFAULT_RUN = "default"
MEMORY_URL = "memory://"
MAX_BODY_ENV = "PARKWAY_MAX_BODY_BYTES"
CLUSTER_WAIT_ENV = "PARKWAY_CLUSTER_WAIT_S"
BROKER_WAIT_ENV = "PARKWAY_BROKER_WAIT_S"
DEFAULT_CLUSTER_WAIT_S = 120.0
DEFAULT_BROKER_WAIT_S = 30.0
MAX_DEADLINE_ENV = "PARKWAY_MAX_DEADLINE_S"
DEFAULT_MAX_DEADLINE_S = DEFAULT_MAX_LEASE_S  # a deadline that far ahead still lapses (protocol.phases)
REPLY_JOURNAL_MAX_BYTES_ENV = "PARKWAY_REPLY_JOURNAL_MAX_BYTES"
DEFAULT_REPLY_JOURNAL_MAX_BYTES = 4 << 20
MIN_REPLY_JOURNAL_MAX_BYTES = 64 << 10
REPLY_CACHE_MAX_BYTES_ENV = "PARKWAY_REPLY_CACHE_MAX_BYTES"
DEFAULT_REPLY_CACHE_MAX_BYTES = 16 << 20
MIN_REPLY_CACHE_MAX_BYTES = 64 << 10
REPLY_MAX_AGE_ENV = "PARKWAY_REPLY_MAX_AGE_S"
DEFAULT_REPLY_MAX_AGE_S = 2 * DEFAULT_MAX_DEADLINE_S  # past any deadline a retry of the command can carry
RECEIPT_RESEND_ENV = "PARKWAY_RECEIPT_RESEND_S"
RECEIPT_RESEND_MAX_ENV = "PARKWAY_RECEIPT_RESEND_MAX_S"
RECEIPT_RESENDS_ENV = "PARKWAY_RECEIPT_RESENDS"
DEFAULT_RESEND_S, DEFAULT_RESEND_MAX_S, DEFAULT_RESENDS = 2.0, 60.0, 30
SIGNING_KEY_ENV = "PARKWAY_SIGNING_KEY"
PUBLIC_KEYS_ENV = "PARKWAY_PUBLIC_KEYS"
SECRET_ENV = "PARKWAY_SECRET"
INSECURE_ENV = "PARKWAY_INSECURE_SHARED_SECRET"
NICE_ENV = "PARKWAY_NICE"
MAX_NICE = 19  # the kernel's lowest priority; raising a priority needs a privilege a service has no need of


class SettingsError(Exception):
    """A setting is missing or malformed; the message says which and how to fix it."""


def max_body_bytes(environ: Mapping[str, str] | None = None) -> int:
    """The largest message body an actor or client accepts and sends: ``PARKWAY_MAX_BODY_BYTES``,
    else ``codec.MAX_BODY_BYTES`` (16 MiB). Keep it at or below the broker's ``max_message_size``."""
    text = (os.environ if environ is None else environ).get(MAX_BODY_ENV, "").strip()
    if not text:
        return codec.MAX_BODY_BYTES
    if not text.isdigit() or int(text) < 1024:
        raise SettingsError(f"{MAX_BODY_ENV}={text!r}: want a number of bytes, at least 1024")
    return int(text)


def cluster_wait_s(environ: Mapping[str, str] | None = None) -> float:
    """How long a controller waits for its participants to answer: ``PARKWAY_CLUSTER_WAIT_S``, else 120 s."""
    return seconds_setting(
        os.environ if environ is None else environ, CLUSTER_WAIT_ENV, DEFAULT_CLUSTER_WAIT_S
    )


def broker_wait_s(environ: Mapping[str, str] | None = None) -> float:
    """How long a service or a run started while its broker is not up (restarting, or starting beside
    it) tries to connect before it gives up: ``PARKWAY_BROKER_WAIT_S``, else 30 s."""
    return seconds_setting(os.environ if environ is None else environ, BROKER_WAIT_ENV, DEFAULT_BROKER_WAIT_S)


def nice_increment(environ: Mapping[str, str] | None = None) -> int:
    """How much a service lowers its own CPU priority at boot: ``PARKWAY_NICE``, else 0 (unchanged)."""
    return parse_nice((os.environ if environ is None else environ).get(NICE_ENV, ""), NICE_ENV)


def parse_nice(text: str, name: str = "--nice") -> int:
    """A niceness increment, 0 to 19 ("" is 0). Refused (SettingsError) otherwise: a negative one would
    raise the priority, which needs privilege and would take cores from the window's own processes."""
    text = text.strip()
    if not text:
        return 0
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_NICE:
        raise SettingsError(f"{name}={text!r}: want a niceness increment, 0 to {MAX_NICE}")
    return int(text)


def seconds_setting(
    environ: Mapping[str, str],
    name: str,
    default: float,
    within: tuple[float, float] | None = None,
    meaning: str = "a number of seconds",
) -> float:
    """A duration from ``environ[name]``; ``default`` when unset. Refused (SettingsError) unless a
    finite number above 0, and within ``within`` (both ends included) when given."""
    text = environ.get(name, "").strip()
    if not text:
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if within is not None:
        low, high = within
        if not low <= seconds <= high:
            raise SettingsError(f"{name}={text!r}: want {meaning}, {low:g} to {high:g}")
    elif not 0 < seconds < float("inf"):
        raise SettingsError(f"{name}={text!r}: want {meaning} above 0")
    return seconds


def max_deadline_s(environ: Mapping[str, str] | None = None) -> float:
    """How far ahead of now a control command's deadline may be: ``PARKWAY_MAX_DEADLINE_S``, else 3600 s."""
    return seconds_setting(
        os.environ if environ is None else environ, MAX_DEADLINE_ENV, DEFAULT_MAX_DEADLINE_S
    )


def reply_journal_max_bytes(environ: Mapping[str, str] | None = None) -> int:
    """The reply journal's size that makes it compacted: ``PARKWAY_REPLY_JOURNAL_MAX_BYTES``, else 4 MiB."""
    text = (os.environ if environ is None else environ).get(REPLY_JOURNAL_MAX_BYTES_ENV, "").strip()
    if not text:
        return DEFAULT_REPLY_JOURNAL_MAX_BYTES
    if not text.isdigit() or int(text) < MIN_REPLY_JOURNAL_MAX_BYTES:
        raise SettingsError(
            f"{REPLY_JOURNAL_MAX_BYTES_ENV}={text!r}: want a number of bytes, at least "
            f"{MIN_REPLY_JOURNAL_MAX_BYTES}"
        )
    return int(text)


def reply_cache_max_bytes(environ: Mapping[str, str] | None = None) -> int:
    """The content the reply cache holds in memory at most: ``PARKWAY_REPLY_CACHE_MAX_BYTES``, else
    16 MiB (the oldest replies are forgotten first)."""
    text = (os.environ if environ is None else environ).get(REPLY_CACHE_MAX_BYTES_ENV, "").strip()
    if not text:
        return DEFAULT_REPLY_CACHE_MAX_BYTES
    if not text.isdigit() or int(text) < MIN_REPLY_CACHE_MAX_BYTES:
        raise SettingsError(
            f"{REPLY_CACHE_MAX_BYTES_ENV}={text!r}: want a number of bytes, at least {MIN_REPLY_CACHE_MAX_BYTES}"
        )
    return int(text)


def reply_max_age_s(environ: Mapping[str, str] | None = None) -> float:
    """How long a cached reply is kept: ``PARKWAY_REPLY_MAX_AGE_S``, else twice the deadline horizon
    (7200 s). Never below ``PARKWAY_MAX_DEADLINE_S``: a command retried within its deadline must still
    find its reply."""
    env = os.environ if environ is None else environ
    age = seconds_setting(env, REPLY_MAX_AGE_ENV, max(DEFAULT_REPLY_MAX_AGE_S, 2 * max_deadline_s(env)))
    if age < max_deadline_s(env):
        raise SettingsError(
            f"{REPLY_MAX_AGE_ENV}={age:g}: below {MAX_DEADLINE_ENV}={max_deadline_s(env):g}; a command "
            "retried before its deadline would be executed again"
        )
    return age


@dataclass(frozen=True, slots=True)
class ReceiptResend:
    """How an agent resends a receipt nobody acknowledged: the pause doubles from ``first_s`` up to
    ``max_s``; after ``give_up_after`` resends the receipt is dropped (the controller's stall timeout,
    or a restore, deals with an attempt whose receipt never arrived)."""

    first_s: float = DEFAULT_RESEND_S
    max_s: float = DEFAULT_RESEND_MAX_S
    give_up_after: int = DEFAULT_RESENDS

    def pause(self, resends: int) -> float:
        """The pause before resend number ``resends + 1``."""
        return min(self.first_s * 2 ** min(resends, 64), self.max_s)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ReceiptResend:
        env = os.environ if environ is None else environ
        first_s = seconds_setting(env, RECEIPT_RESEND_ENV, DEFAULT_RESEND_S)
        max_s = seconds_setting(env, RECEIPT_RESEND_MAX_ENV, max(DEFAULT_RESEND_MAX_S, first_s))
        if max_s < first_s:
            raise SettingsError(f"{RECEIPT_RESEND_MAX_ENV}={max_s}: below {RECEIPT_RESEND_ENV}={first_s}")
        text = env.get(RECEIPT_RESENDS_ENV, "").strip()
        if text and not text.isdigit():
            raise SettingsError(f"{RECEIPT_RESENDS_ENV}={text!r}: want a whole number of resends, 0 or more")
        return cls(first_s=first_s, max_s=max_s, give_up_after=int(text) if text else DEFAULT_RESENDS)


def keyring_from_env(run: str, environ: Mapping[str, str]) -> Keyring | None:
    """The keyring ``PARKWAY_SIGNING_KEY`` and ``PARKWAY_PUBLIC_KEYS`` give, None when neither is set."""
    private_text = environ.get(SIGNING_KEY_ENV, "").strip()
    public_text = environ.get(PUBLIC_KEYS_ENV, "").strip()
    if not private_text and not public_text:
        return None
    if not public_text:
        raise SettingsError(
            f"{SIGNING_KEY_ENV} is set but {PUBLIC_KEYS_ENV} is not: a process needs every role's public "
            "key to check what it receives (parkway keys generate --env prints both)"
        )
    try:
        return Keyring.from_text(private_text, public_text)
    except KeyFormatError as exc:
        raise SettingsError(f"{SIGNING_KEY_ENV} / {PUBLIC_KEYS_ENV}: {exc}") from None


@dataclass(frozen=True, slots=True)
class RunSettings:
    run: str
    secret: bytes  # b"" when the keys come from PARKWAY_SIGNING_KEY
    broker_url: str
    state_root: Path
    metrics_port: int = 0  # 0: no metrics endpoint
    keyring: Keyring = field(default_factory=Keyring)
    shared_secret: bool = False  # the keyring was derived from PARKWAY_SECRET: it holds every role's key
    broker_wait_s: float = DEFAULT_BROKER_WAIT_S  # a service or run started before its broker waits so long

    def refuse_shared_secret(self, what: str) -> None:
        """A service process on a real broker must hold its own role's key only; raise unless the
        operator chose the shared secret on purpose (``PARKWAY_INSECURE_SHARED_SECRET=1``)."""
        if not self.shared_secret or self.broker_url.startswith(MEMORY_URL):
            return
        if os.environ.get(INSECURE_ENV, "").strip() == "1":
            return
        raise SettingsError(
            f"{what} was given only {SECRET_ENV}, from which every role's key derives: any holder could "
            f"command the cluster. Set {SIGNING_KEY_ENV} (this role's key) and {PUBLIC_KEYS_ENV} "
            f"(parkway keys generate --env), or {INSECURE_ENV}=1 to accept the shared secret"
        )

    @classmethod
    def from_env(
        cls,
        *,
        broker_url: str | None = None,
        run: str | None = None,
        allow_ephemeral_secret: bool = False,
        metrics_port: int | None = None,
    ) -> RunSettings:
        url = broker_url or os.environ.get("PARKWAY_BROKER_URL") or MEMORY_URL
        run_name = run or os.environ.get("PARKWAY_RUN") or DEFAULT_RUN
        try:
            validate_name(run_name, "run")
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        keyring = keyring_from_env(run_name, os.environ)
        secret_text = os.environ.get(SECRET_ENV, "")
        if keyring is None and not secret_text:
            if not (allow_ephemeral_secret or url.startswith(MEMORY_URL)):
                raise SettingsError(
                    f"no keys: set {SIGNING_KEY_ENV} and {PUBLIC_KEYS_ENV} (parkway keys generate --env; "
                    f"every message is signed with its sender role's key), or {SECRET_ENV} for an "
                    "operator's tool (see .env.example)"
                )
            secret_text = secrets.token_hex(32)
        state_root = Path(os.environ.get("PARKWAY_STATE_DIR", ".parkway"))
        if metrics_port is None:
            text = os.environ.get("PARKWAY_METRICS_PORT", "").strip() or "0"
            if not text.isdigit():
                raise SettingsError(f"PARKWAY_METRICS_PORT={text!r}: want a TCP port, 0 to 65535 (0: off)")
            metrics_port = int(text)
        if not 0 <= metrics_port <= 65535:
            raise SettingsError(f"metrics port {metrics_port}: want a TCP port, 0 to 65535 (0: off)")
        secret = b"" if keyring is not None else secret_text.encode()
        return cls(
            run=run_name,
            secret=secret,
            broker_url=url,
            state_root=state_root,
            metrics_port=metrics_port,
            keyring=keyring if keyring is not None else Keyring.derive(secret, run_name),
            shared_secret=keyring is None,
            broker_wait_s=broker_wait_s(),
        )
