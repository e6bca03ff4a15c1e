"""Who may send what: the authorization table every receiver checks after a signature verifies.

An identity is the role whose key signed (``protocol.signing``). A sender address names a role
(``agent/1``) or an operator's tool (``cli/4242``, any first part that is not a role): a role address
must be signed by that role's key; a tool signs with whatever key its operator gave it, and is then
that role. Control commands come from the controller only; each data message from the role that
sends it in the protocol; queries (``Status``, ``Discover``, ``Probe``) from any identity of the run.
Replies are not requests: no one may send one to an actor's queue; a requester accepts a reply only
from the role it addressed (checked by the client, which knows where it sent the request).
"""

from __future__ import annotations

from parkway.protocol.ids import Role

_ALL = frozenset(role.value for role in Role)
_CONTROLLER = frozenset({Role.CONTROLLER.value})

# Request type -> the roles that may send it.
SENDERS: dict[str, frozenset[str]] = {
    # control commands: the controller drives every save, restore and retirement
    "Prepare": _CONTROLLER,
    "Renew": _CONTROLLER,
    "Commit": _CONTROLLER,
    "Persist": _CONTROLLER,
    "Resume": _CONTROLLER,
    "Abort": _CONTROLLER,
    "Restore": _CONTROLLER,
    "Retire": _CONTROLLER,
    "Forget": _CONTROLLER,
    "Snapshot": _CONTROLLER,  # "snapshot now", to the controller: an operator with the controller key
    "LoadWeights": _CONTROLLER,
    # queries: read-only, or (Probe) an idempotent test command with its own log
    "Status": _ALL,
    "Discover": _ALL,
    "Probe": _ALL,
    "MemoryReport": _CONTROLLER,  # what a process holds, its code's lines: an operator with that key
    # data
    "Run": _CONTROLLER,  # controller -> agent: a rollout to run
    "Ack": _CONTROLLER,  # controller -> agent: receipts recorded
    "SealRows": _CONTROLLER,  # controller -> tq
    "ReleaseRows": _CONTROLLER,  # controller -> tq
    "Train": _CONTROLLER,  # controller -> trainer
    "TrainerSync": _CONTROLLER,  # controller -> trainer
    "Generate": frozenset({Role.AGENT.value}),  # agent -> policy
    "ToolCall": frozenset({Role.AGENT.value}),  # agent -> resources
    "Completed": frozenset({Role.AGENT.value}),  # agent -> controller: receipt
    "Failed": frozenset({Role.AGENT.value}),  # agent -> controller: receipt
    "Rows": frozenset({Role.POLICY.value}),  # policy -> tq: staging rows of a generation
    "FetchRows": frozenset({Role.TRAINER.value}),  # trainer -> tq
}

# Reply types: sent only to a requester's reply address, never accepted on an actor's queue.
REPLIES: frozenset[str] = frozenset(
    {
        "Error",
        "Ok",
        "Capabilities",
        "StatusReport",
        "Prepared",
        "Committed",
        "Persisted",
        "Restored",
        "SnapshotTaken",
        "WeightsLoaded",
        "ProbeResult",
        "MemoryUsage",
        "Generated",
        "ToolResult",
        "CanonicalRows",
        "Trained",
        "TrainerAt",
    }
)


def address_role(address: str) -> str | None:
    """The role an address names (``agent`` for ``agent/1``), None for a tool's address."""
    role = address.partition("/")[0]
    return role if role in _ALL else None


def sender_refusal(sender: str, key_role: str) -> str | None:
    """Why a message from ``sender`` signed by ``key_role``'s key is refused, or None if it may be."""
    if key_role not in _ALL:
        return f"signed by {key_role or 'no'} key, not a role's"
    named = address_role(sender)
    if named is not None and named != key_role:
        return f"sender {sender} is a {named} address but the message is signed by the {key_role} key"
    return None


def request_refusal(key_role: str, message_type: str) -> str | None:
    """Why ``key_role`` may not send a ``message_type`` request, or None if it may."""
    allowed = SENDERS.get(message_type)
    if allowed is None:
        what = "a reply" if message_type in REPLIES else "not a request type"
        return f"{message_type or 'an untyped message'} is {what}; no one may send it to an actor"
    if key_role not in allowed:
        return f"the {key_role} role may not send {message_type} (only {', '.join(sorted(allowed))})"
    return None


def signing_role(sender: str, message_type: str, held: frozenset[str] | set[str]) -> str | None:
    """Which of the ``held`` private keys a sender signs ``message_type`` with: its own role's key for a
    role address; for a tool, a held role allowed to send it (the controller's first), else any held
    one (a reply, or a request the receiver will refuse). None: no key to sign with."""
    named = address_role(sender)
    if named is not None:
        return named if named in held else None
    allowed = SENDERS.get(message_type, _ALL)
    preference = [Role.CONTROLLER.value, *sorted(held)]
    for role in preference:
        if role in held and role in allowed:
            return role
    return preference[0] if Role.CONTROLLER.value in held else min(held, default=None)
