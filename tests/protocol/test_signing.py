from parkway.protocol.signing import sign, verify

FACTS = {"run": "r1", "sender": "controller/0", "correlation_id": "ck-1", "content_type": "application/json"}


def test_signature_verifies_with_the_same_secret_and_facts() -> None:
    signature = sign(b"s", body=b"{}", **FACTS)
    assert verify(b"s", signature, body=b"{}", **FACTS)


def test_any_changed_fact_breaks_the_signature() -> None:
    signature = sign(b"s", body=b"{}", **FACTS)
    assert not verify(b"other", signature, body=b"{}", **FACTS)
    assert not verify(b"s", signature, body=b"{ }", **FACTS)
    assert not verify(b"s", None, body=b"{}", **FACTS)
    for key, value in [("run", "r2"), ("sender", "cli/1"), ("correlation_id", "ck-2"), ("content_type", "x")]:
        assert not verify(b"s", signature, body=b"{}", **{**FACTS, key: value})
