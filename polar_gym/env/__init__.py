"""The NeMo Gym environment plugin. Polar side: ``python -m polar_gym.env serve`` (a rollout server + gateway for
the agent) and ``polar_gym.env.tasks`` (rows to TaskRequests); the rollout server's ``/sessions/{id}/nemo`` payload
comes from ``polar_gym.merge.nemo_payload``. Gym side (runs in NeMo Gym's interpreter):
``responses_api_agents/polar_gym_agent`` and ``resources_servers/polar_gym_resources`` in this folder, found by
``gym ... --search-dir <this folder>``."""
