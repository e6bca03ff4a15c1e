"""Tests of ``actors/``, one folder per package; the modules right here test the whole in-memory
cluster across packages (recovery, the review findings, hostile input)."""
