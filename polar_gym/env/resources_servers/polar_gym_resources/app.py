"""Resources server of the polar_gym agent: the reward is Polar's evaluator's (the task's own tests, SWE-bench
grading, ...), already computed on the Polar side and carried in the agent's response metadata
(``polar_reward``); verify() returns it, so NeMo Gym's verify step stays the single place rewards come from."""

from __future__ import annotations

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from pydantic import ConfigDict


class PolarGymVerifyRequest(BaseVerifyRequest):
    model_config = ConfigDict(extra="allow")


class PolarGymVerifyResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")


class PolarGymResources(SimpleResourcesServer):
    config: BaseResourcesServerConfig
    ray_enabled = False

    async def verify(self, body: PolarGymVerifyRequest) -> PolarGymVerifyResponse:
        metadata = body.response.metadata or {}
        raw = metadata.get("polar_reward")
        if raw in (None, ""):  # the session produced no evaluation (error, timeout before evaluation)
            return PolarGymVerifyResponse(**body.model_dump(), reward=0.0, failure_kind="polar_no_reward",
                                          failure_reason=f"Polar session {metadata.get('polar_status')}: no reward")
        return PolarGymVerifyResponse(**body.model_dump(), reward=float(raw))


if __name__ == "__main__":
    PolarGymResources.run_webserver()
