"""The five roles: controller, agent, resources, policy, tq."""
