import pytest
from parkway.protocol.signing import ROLES, KeyFormatError, Keyring, signing_input

FACTS = {
    "run": "r1",
    "sender": "controller/0",
    "key_role": "controller",
    "to": "agent/0",
    "message_type": "Prepare",
    "correlation_id": "ck-1",
    "message_id": "m1",
    "content_type": "application/json",
}


def test_a_signature_verifies_with_the_signing_role_public_key_and_the_same_facts() -> None:
    keys = Keyring.generate()
    data = signing_input(body=b"{}", **FACTS)
    signature = keys.sign("controller", data)
    assert keys.verify("controller", data, signature)
    assert not keys.verify("agent", data, signature)  # another role's public key
    assert not keys.verify("controller", data, None)
    assert not keys.verify("controller", data, "not base64!")


def test_any_changed_fact_breaks_the_signature() -> None:
    keys = Keyring.generate()
    signature = keys.sign("controller", signing_input(body=b"{}", **FACTS))
    assert not keys.verify("controller", signing_input(body=b"{ }", **FACTS), signature)
    for key in FACTS:
        changed = signing_input(body=b"{}", **{**FACTS, key: FACTS[key] + "x"})
        assert not keys.verify("controller", changed, signature), key


def test_fields_are_length_prefixed_so_moving_a_separator_changes_the_input() -> None:
    one = signing_input(body=b"", **{**FACTS, "to": "agent/0", "message_type": "Prepare"})
    two = signing_input(body=b"", **{**FACTS, "to": "agent/0P", "message_type": "repare"})
    assert one != two


def test_derived_keys_are_per_secret_and_per_run() -> None:
    one, again = Keyring.derive(b"s", "r1"), Keyring.derive(b"s", "r1")
    assert one.public_text() == again.public_text()
    assert one.public_text() != Keyring.derive(b"s", "r2").public_text()
    assert one.public_text() != Keyring.derive(b"t", "r1").public_text()
    assert set(one.private) == set(ROLES)


def test_text_forms_round_trip_and_hold_only_the_chosen_private_keys() -> None:
    keys = Keyring.generate()
    agent = Keyring.from_text(keys.private_text(["agent"]), keys.public_text())
    assert set(agent.private) == {"agent"} and set(agent.public) == set(ROLES)
    data = signing_input(body=b"x", **FACTS)
    assert keys.verify("agent", data, agent.sign("agent", data))
    with pytest.raises(KeyError, match="no signing key for role 'controller'"):
        agent.sign("controller", data)


@pytest.mark.parametrize(
    ("private", "public", "message"),
    [
        ("agent:AAAA", None, "want 32 bytes"),
        ("agent:***", None, "not base64"),
        ("boss:AAAA", None, "is not ROLE:BASE64"),
        ("", "", "empty"),
        (None, None, "does not match the public key table"),
    ],
)
def test_malformed_key_text_is_a_typed_error(private: str | None, public: str | None, message: str) -> None:
    keys, other = Keyring.generate(), Keyring.generate()
    private_text = other.private_text(["agent"]) if private is None else private
    with pytest.raises(KeyFormatError, match=message):
        Keyring.from_text(private_text, keys.public_text() if public is None else public)
