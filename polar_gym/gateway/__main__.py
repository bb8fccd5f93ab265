"""``python -m polar_gym.gateway``: a gateway node (options and behaviour: :mod:`polar_gym.gateway.cli`)."""

from __future__ import annotations

from polar_gym.gateway.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
