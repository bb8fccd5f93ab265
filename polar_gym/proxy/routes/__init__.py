"""The proxy's routers, one per concern (vLLM entrypoints style: routes read the service from ``app.state``):
``models`` (the provider APIs and provider detection), ``sessions`` (captures and trajectories), ``admin``."""

from polar_gym.proxy.routes import admin, models, sessions

__all__ = ["admin", "models", "sessions"]
