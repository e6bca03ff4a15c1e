"""The workspace environment (docs/workspace.md): a directory per rollout, seeded from a template, with
file tools and a command tool, recorded at each boundary as a manifest over a content-addressed store.

``paths`` (what a tool may touch), ``store`` (the blobs), ``tree`` (manifests: scan and materialise),
``template`` (seeding from a directory or an archive), ``executor`` (running commands under limits),
``environment`` (the ``Workspace`` environment itself).
"""
