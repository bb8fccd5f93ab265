"""Training/inference mismatch audit: recompute captured tokens' logprobs with transformers and compare them with
what the engine reported (``python -m polar_gym.audit``). :mod:`polar_gym.audit.metrics` holds the metric
functions a trainer imports; :mod:`polar_gym.audit.recompute` the head-only-where-needed forward."""

__all__: list[str] = []
