"""The CLI and the tools over a run: status, progress, snapshots, report."""
