"""``python -m polar_gym.proxy``: the standalone proxy (options and behaviour: :mod:`polar_gym.proxy.cli`)."""

from __future__ import annotations

from polar_gym.proxy.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
