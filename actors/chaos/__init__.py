"""The nemesis: seeded faults over a real cluster, and the history checker."""
