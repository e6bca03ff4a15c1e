"""Snapshots on disk: what is there, and what is wrong with it."""
