"""env (arrives with its issue)."""
