"""apptainer (arrives with its issue)."""
