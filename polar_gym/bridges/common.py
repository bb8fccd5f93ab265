"""What every trainer bridge shares: where the rollout server is (``POLAR_*`` environment variables, since most
trainers build the bridge themselves, in their own workers) and a trainer's sampling values as a task's override."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from polar_gym.schema import SamplingOverride

__all__ = ["BridgeSettings", "run_sync", "trainer_sampling"]

_T = TypeVar("_T")


class BridgeSettings(BaseModel):
    """The rollout server a bridge submits to, how long a batch may take, and what a session with several chains
    (sub-agents, compaction) gives: its main chain, or an error (``fail``)."""

    model_config = ConfigDict(extra="forbid")

    server_url: str
    admin_token: str
    timeout_seconds: float = Field(default=7200.0, gt=0)
    extra_chains: Literal["main", "fail"] = "main"

    #: the bridge's name in the error that says what is missing
    bridge_name: ClassVar[str] = "the bridge"

    @classmethod
    def server_env(cls, environ: Mapping[str, str] | None, where: str = "") -> dict[str, Any]:
        """The fields ``POLAR_SERVER_URL``, ``POLAR_ADMIN_TOKEN``, ``POLAR_TIMEOUT_SECONDS`` and
        ``POLAR_EXTRA_CHAINS`` give (the first two required); ``where`` says where a missing one must be set."""
        env = os.environ if environ is None else environ
        missing = [k for k in ("POLAR_SERVER_URL", "POLAR_ADMIN_TOKEN") if not env.get(k)]
        if missing:
            raise RuntimeError(f"{cls.bridge_name} needs {' and '.join(missing)} (the Polar rollout server){where}")
        optional = {"timeout_seconds": env.get("POLAR_TIMEOUT_SECONDS"), "extra_chains": env.get("POLAR_EXTRA_CHAINS")}
        return {"server_url": env["POLAR_SERVER_URL"], "admin_token": env["POLAR_ADMIN_TOKEN"],
                **{k: v for k, v in optional.items() if v}}


def trainer_sampling(temperature: Any, top_p: Any, top_k: Any) -> SamplingOverride:
    """A trainer's sampling values as the override a task forces on every model call; a top_k of 0 or less (the
    trainers' "off") is -1, all tokens."""
    k = int(top_k or -1)
    return SamplingOverride(temperature=float(1.0 if temperature is None else temperature),
                            top_p=None if top_p is None else float(top_p), top_k=k if k > 0 else -1)


def run_sync(make: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """``asyncio.run`` of a trainer's synchronous hook, in a thread of its own when the trainer calls from inside an
    event loop (a notebook, an async trainer)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()
