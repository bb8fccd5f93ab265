"""evaluate (arrives with its issue)."""
