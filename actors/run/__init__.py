"""What a run is: its typed configuration and its tasks."""
