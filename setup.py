"""Package discovery: every package under the three top folders, installed as ``parkway.<folder>``.

The repository keeps ``actors/``, ``protocol/`` and ``brokers/`` at its top (the layout users asked for)
and installs them under one namespace, so the import names never collide with the PyPI distributions
``protocol`` and ``actors``. Packages are found, not listed: a new subpackage cannot be left out of the
wheel (a hand-written list once left ``parkway.actors.engines`` out). Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

TOP = ("actors", "protocol", "brokers")

setup(
    package_dir={f"parkway.{top}": top for top in TOP},
    packages=[
        f"parkway.{name}"
        for name in find_packages(include=[pattern for top in TOP for pattern in (top, f"{top}.*")])
    ],
)
