"""Anthropic Messages front end (``/v1/messages`` and ``/v1/messages/count_tokens``)."""

from polar_gym.proxy.providers.anthropic.translate import AnthropicProvider

__all__ = ["AnthropicProvider"]
