"""merge (arrives with its issue)."""
