"""The loop on one machine: ``weightcast up``, its toy rollout task, a private redis-server."""
