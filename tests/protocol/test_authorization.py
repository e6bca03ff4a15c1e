import msgspec
import pytest
from parkway.protocol import messages
from parkway.protocol.authorization import (
    REPLIES,
    SENDERS,
    request_refusal,
    sender_refusal,
    signing_role,
)
from parkway.protocol.ids import Role

CONTROL = [
    cls.__name__ for cls in messages.CONTROL_COMMANDS if cls.__name__ not in ("Status", "Discover", "Probe")
]


def concrete_messages() -> set[str]:
    found, todo = set(), [messages.Message]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__struct_config__.tag is not None and not cls.__name__.startswith("_"):
            found.add(cls.__name__)
    return found - {"Message", "ControlCommand", "SnapshotCommand", "TemporaryLocation"}


def test_every_message_type_is_a_request_with_its_senders_or_a_reply() -> None:
    assert not set(SENDERS) & REPLIES
    assert concrete_messages() <= set(SENDERS) | REPLIES, concrete_messages() - set(SENDERS) - set(REPLIES)
    assert set(SENDERS) | REPLIES <= concrete_messages()


def test_control_commands_come_from_the_controller_only() -> None:
    assert CONTROL and all(issubclass(getattr(messages, name), messages.ControlCommand) for name in CONTROL)
    for name in CONTROL:
        assert request_refusal("controller", name) is None
        for role in Role:
            if role is not Role.CONTROLLER:
                assert request_refusal(role.value, name) == (
                    f"the {role.value} role may not send {name} (only controller)"
                )


@pytest.mark.parametrize("name", ["Status", "Discover", "Probe"])
def test_queries_come_from_any_role(name: str) -> None:
    assert all(request_refusal(role.value, name) is None for role in Role)


@pytest.mark.parametrize(
    ("name", "sender"),
    [
        ("Run", "controller"),
        ("Ack", "controller"),
        ("Generate", "agent"),
        ("ToolCall", "agent"),
        ("Completed", "agent"),
        ("Failed", "agent"),
        ("Rows", "policy"),
        ("FetchRows", "trainer"),
        ("SealRows", "controller"),
        ("Train", "controller"),
    ],
)
def test_data_comes_only_from_the_role_that_sends_it(name: str, sender: str) -> None:
    assert SENDERS[name] == {sender}
    assert request_refusal(sender, name) is None
    assert all(request_refusal(r.value, name) is not None for r in Role if r.value != sender)


def test_a_reply_or_an_unknown_type_is_never_a_request() -> None:
    assert request_refusal("controller", "Prepared") == "Prepared is a reply; no one may send it to an actor"
    assert (
        request_refusal("controller", "Nope") == "Nope is not a request type; no one may send it to an actor"
    )


def test_a_role_address_must_be_signed_by_its_role_and_a_tool_by_any_role() -> None:
    assert sender_refusal("agent/1", "agent") is None
    assert sender_refusal("controller/0", "agent") == (
        "sender controller/0 is a controller address but the message is signed by the agent key"
    )
    assert sender_refusal("cli/4242", "controller") is None
    assert sender_refusal("cli/4242", "root") == "signed by root key, not a role's"


def test_the_signing_key_is_the_sender_role_or_for_a_tool_one_allowed_to_send_it() -> None:
    every = {role.value for role in Role}
    assert signing_role("agent/0", "Prepare", every) == "agent"  # never borrows the controller's
    assert signing_role("agent/0", "Generate", {"controller"}) is None
    assert signing_role("cli/1", "Prepare", every) == "controller"
    assert signing_role("test/0", "Generate", every) == "agent"
    assert signing_role("test/0", "Rows", every) == "policy"
    assert signing_role("cli/1", "Status", {"agent"}) == "agent"
    assert signing_role("cli/1", "Prepare", {"agent"}) == "agent"  # signed; the receiver refuses it
    assert signing_role("cli/1", "Prepare", set()) is None


def test_the_table_is_plain_data() -> None:
    msgspec.json.encode({name: sorted(roles) for name, roles in SENDERS.items()})
