"""The actor runtime every role shares: the delivery pipeline, participants, clients, logs, metrics."""
