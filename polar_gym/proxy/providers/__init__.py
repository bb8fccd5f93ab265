"""Front ends, one folder per provider protocol."""
