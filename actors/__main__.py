"""``python -m parkway.actors``: the ``parkway`` command, for environments without its script on PATH."""

from parkway.actors.tools.cli import main

if __name__ == "__main__":  # spawned children (vLLM's engine) import this module again as __mp_main__
    raise SystemExit(main())
