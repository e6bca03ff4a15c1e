"""What users write agents, environments and trainers against."""
