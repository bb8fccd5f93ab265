"""gateway (arrives with its issue)."""
