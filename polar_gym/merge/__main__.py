"""``python -m polar_gym.merge``: see :mod:`polar_gym.merge.cli`."""

import sys

from polar_gym.merge.cli import main

__all__: list[str] = []

sys.exit(main())
