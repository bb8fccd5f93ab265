"""OpenAI Chat Completions front end."""

from polar_gym.proxy.providers.openai_chat.translate import OpenAIChatProvider

__all__ = ["OpenAIChatProvider"]
