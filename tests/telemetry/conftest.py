"""Fixtures of this folder, from the kits that own them: a real served gateway (``make_gateway``) and the local
Slurm (``slurm_env``, for the slurm-tier span test)."""

from tests.gateway._gateway_kit import make_gateway  # noqa: F401
from tests.launch.test_slurm_real import slurm_env  # noqa: F401
