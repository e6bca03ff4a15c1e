"""Snapshots on disk: writing them durably, what is there, what is wrong with it, which one restores.

    files.py      digests, fsync of files and directories, durable writes
    runs.py       one run's directory: its snapshots, temporary directories, COMPLETED marker
    publish.py    what the controller writes into a snapshot, and its publication and pruning
    trainer.py    a trainer checkpoint's fallback marker and state
    checks.py     every problem of one snapshot
    select.py     verify and select the snapshot a restore starts from
    inventory.py  a run's snapshots as ``parkway snapshots`` lists them

Names and formats come from ``protocol`` (``layout``, ``manifest``, ``anchor``); nothing here imports
the controller.
"""
