"""Actors: the runtime every actor shares, the roles (controller, agent, resources, policy, tq), the CLI."""
