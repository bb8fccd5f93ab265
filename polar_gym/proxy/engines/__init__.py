"""Engines behind one interface: vllm, sglang, openai (not token-faithful) and the oracle policy."""

from polar_gym.proxy.engines.base import Engine, HttpEngine

__all__ = ["Engine", "HttpEngine"]
