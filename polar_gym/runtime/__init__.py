"""runtime (arrives with its issue)."""
