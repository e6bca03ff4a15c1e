"""Where the checkout's files are, for tests that read the examples, compose.yaml or the Dockerfile."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # tests/support/paths.py -> the repository
EXAMPLES = ROOT / "examples"
