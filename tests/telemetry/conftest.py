"""The gateway kit's fixture (a real served gateway) for the in-process span tests."""

from tests.gateway._gateway_kit import make_gateway  # noqa: F401
