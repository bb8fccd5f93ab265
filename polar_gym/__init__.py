"""polar_gym: agentic RL on unmodified agent harnesses."""

__version__ = "0.1.0"
