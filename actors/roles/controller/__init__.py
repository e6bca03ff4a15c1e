"""The controller: the run's only coordinator, its snapshots and its restore."""
