"""Google Gemini generateContent front end (generateContent, streamGenerateContent, countTokens)."""

from polar_gym.proxy.providers.google.translate import GoogleProvider

__all__ = ["GoogleProvider"]
