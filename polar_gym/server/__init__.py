"""server (arrives with its issue)."""
