"""Output parsers: the sampled text of a token-in engine -> reasoning, content and tool calls (one per model family).

Import the interface from :mod:`polar_gym.proxy.parsers.base`; families are looked up by name via
:func:`~polar_gym.proxy.parsers.base.parser_for` (the ``PARSERS`` registry), so naming one costs no import.
"""
