"""Trainer bridges: how a trainer that does not speak HTTP drives the rollout server (Slime's rollout function).
Any other trainer uses :class:`polar_gym.server.client.RolloutClient` directly."""
