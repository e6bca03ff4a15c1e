"""The agents, environments and trainers parkway ships, registered as plugins like any other."""
