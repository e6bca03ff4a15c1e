"""Where a process's keys come from: PARKWAY_SIGNING_KEY and PARKWAY_PUBLIC_KEYS, or a secret."""

from __future__ import annotations

import pytest
from parkway.actors.runtime.settings import RunSettings, SettingsError
from parkway.actors.tools.cli import main
from parkway.protocol.signing import Keyring

URL = "amqp://guest:guest@127.0.0.1:1/"  # never reached: every case here is decided before connecting


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (
        "PARKWAY_SECRET",
        "PARKWAY_SIGNING_KEY",
        "PARKWAY_PUBLIC_KEYS",
        "PARKWAY_INSECURE_SHARED_SECRET",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PARKWAY_BROKER_URL", URL)
    return monkeypatch


def test_a_process_given_its_role_key_holds_that_key_only(clean: pytest.MonkeyPatch) -> None:
    keys = Keyring.generate()
    clean.setenv("PARKWAY_SIGNING_KEY", keys.private_text(["agent"]))
    clean.setenv("PARKWAY_PUBLIC_KEYS", keys.public_text())
    settings = RunSettings.from_env()
    assert set(settings.keyring.private) == {"agent"} and not settings.shared_secret
    assert settings.keyring.public_text() == keys.public_text()
    settings.refuse_shared_secret("parkway actor agent")  # nothing to refuse


@pytest.mark.parametrize(
    ("signing", "public", "message"),
    [
        ("agent:AAAA", None, "want 32 bytes"),
        (None, "", "PARKWAY_SIGNING_KEY is set but PARKWAY_PUBLIC_KEYS is not"),
        ("other", None, "does not match the public key table"),
    ],
)
def test_bad_keys_are_a_settings_error_naming_the_variable(
    clean: pytest.MonkeyPatch, signing: str | None, public: str | None, message: str
) -> None:
    keys, other = Keyring.generate(), Keyring.generate()
    chosen = {None: keys.private_text(["tq"]), "other": other.private_text(["tq"])}.get(signing, signing)
    clean.setenv("PARKWAY_SIGNING_KEY", chosen or "")
    if public is None:
        clean.setenv("PARKWAY_PUBLIC_KEYS", keys.public_text())
    with pytest.raises(SettingsError, match=message):
        RunSettings.from_env()


def test_no_keys_and_no_secret_on_a_real_broker_is_refused(clean: pytest.MonkeyPatch) -> None:
    with pytest.raises(SettingsError, match="no keys: set PARKWAY_SIGNING_KEY and PARKWAY_PUBLIC_KEYS"):
        RunSettings.from_env()


def test_parkway_actor_refuses_a_bare_shared_secret(
    clean: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clean.setenv("PARKWAY_SECRET", "s3cret")
    assert main(["actor", "tq", "--broker", URL]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "parkway: parkway actor tq was given only PARKWAY_SECRET, from which every role's key"
    )
    assert "PARKWAY_INSECURE_SHARED_SECRET=1" in err


def test_the_shared_secret_is_accepted_when_chosen_on_purpose(clean: pytest.MonkeyPatch) -> None:
    clean.setenv("PARKWAY_SECRET", "s3cret")
    settings = RunSettings.from_env()
    assert settings.shared_secret and set(settings.keyring.private) == set(
        Keyring.derive(b"s3cret", "default").private
    )
    clean.setenv("PARKWAY_INSECURE_SHARED_SECRET", "1")
    settings.refuse_shared_secret("parkway actor tq")  # no error


def test_keys_generate_env_prints_every_role_key_and_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "generate", "--env"]) == 0
    lines = dict(
        line.partition("=")[::2] for line in capsys.readouterr().out.splitlines() if not line.startswith("#")
    )
    roles = ("controller", "agent", "policy", "resources", "tq", "trainer")
    assert set(lines) == {f"PARKWAY_KEY_{r.upper()}" for r in roles} | {"PARKWAY_PUBLIC_KEYS"}
    for role in roles:
        keyring = Keyring.from_text(lines[f"PARKWAY_KEY_{role.upper()}"], lines["PARKWAY_PUBLIC_KEYS"])
        assert set(keyring.private) == {role}
