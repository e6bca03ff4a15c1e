"""``parkway keys generate``: a fresh key pair for every role of a run.

``--env`` prints ``.env`` lines: ``PARKWAY_KEY_<ROLE>`` (that role's private key, which compose hands
to that role's services only, as their ``PARKWAY_SIGNING_KEY``) and ``PARKWAY_PUBLIC_KEYS`` (every
role's public key, which every process gets). Whoever holds ``PARKWAY_KEY_CONTROLLER`` commands the
cluster: keep it with the controller and the operator.
"""

from __future__ import annotations

import argparse

from parkway.actors.runtime.settings import PUBLIC_KEYS_ENV
from parkway.actors.tools.commands.options import Subcommands, print_json
from parkway.protocol.signing import ROLES, Keyring


def role_key_variable(role: str) -> str:
    """The ``.env`` variable that holds ``role``'s private key: ``PARKWAY_KEY_AGENT``."""
    return f"PARKWAY_KEY_{role.upper()}"


def add_keys(sub: Subcommands) -> None:
    p = sub.add_parser("keys", help="make a fresh Ed25519 key pair for every role (generate)")
    actions = p.add_subparsers(required=True, metavar="ACTION")
    generate = actions.add_parser("generate", help="print every role's private key and the public table")
    generate.add_argument(
        "--env", action="store_true", help="as .env lines (PARKWAY_KEY_<ROLE>=..., PARKWAY_PUBLIC_KEYS=...)"
    )
    generate.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    keyring = Keyring.generate()
    if args.env:
        print("# parkway keys generate --env: each service gets its own role's key as PARKWAY_SIGNING_KEY.")
        print("# Whoever holds PARKWAY_KEY_CONTROLLER commands the cluster.")
        for role in ROLES:
            print(f"{role_key_variable(role)}={keyring.private_text([role])}")
        print(f"{PUBLIC_KEYS_ENV}={keyring.public_text()}")
        return 0
    print_json(
        {
            "private": {role: keyring.private_text([role]) for role in ROLES},
            "public": keyring.public_text(),
        }
    )
    return 0
