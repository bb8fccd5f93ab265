"""Working test doubles for the gateway tests (faked edges: the harness CLI, the evaluator, the stage functions).

- ``CurlHarness``: a harness whose command is a shell script that calls the proxy's chat endpoint with curl through
  the runtime's gateway URL (network "gateway"), ``calls`` times, then sleeps ``sleep`` seconds and exits with
  ``exit_code``; it writes ``$HOME/harness.log`` (its log path).
- ``PassEvaluator``: reward 1.0 when the harness exited 0; ``FreshEvaluator`` asks for a fresh runtime and checks it
  is a different, working sandbox; ``SleepyEvaluator`` runs ``sleep`` inside the live runtime (to cancel in
  EVALUATING); ``BrokenEvaluator`` raises.
- ``ScriptedStages``: stage functions that sleep for per-session durations (``metadata.durations``), stay in the
  stage ``metadata.hold`` names until the test opens the session's gate (``stages.gate(id).set()``), fail where
  ``metadata.fail`` says, and count what they did (teardowns, peak concurrency per stage).
"""

from __future__ import annotations

import asyncio
import collections
import json
from typing import Any, ClassVar

from polar_gym.evaluate.base import EvalContext, Evaluator
from polar_gym.gateway import Session, Stages
from polar_gym.harness.base import Harness, HarnessContext
from polar_gym.schema import EvalResult, Trajectory

__all__ = ["BrokenEvaluator", "CurlHarness", "FreshEvaluator", "PassEvaluator", "ScriptedStages",
           "SleepyEvaluator"]

_SCRIPT = r"""
log="$HOME/harness.log"
echo "start" >> "$log"
i=0
while [ "$i" -lt "$POLAR_CALLS" ]; do
  body=$(printf '{"model":"%s","messages":[{"role":"user","content":"%s (call %s)"}],"tools":%s}' \
         "$POLAR_MODEL" "$POLAR_INSTRUCTION" "$i" "$POLAR_TOOLS")
  curl -sS --fail-with-body -X POST "$POLAR_URL/v1/chat/completions" -H "Authorization: Bearer $POLAR_KEY" \
       -H "content-type: application/json" -d "$body" >> "$log" || exit 7
  echo >> "$log"
  i=$((i+1))
  [ "$i" -lt "$POLAR_CALLS" ] && sleep "$POLAR_GAP"
done
echo "calls done" >> "$log"
sleep "$POLAR_SLEEP"
echo "end" >> "$log"
exit "$POLAR_EXIT"
"""


_BASH_TOOL = {"type": "function", "function": {
    "name": "bash", "description": "run a command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


class CurlHarness(Harness):
    name = "test_curl"
    provider = "openai_chat"

    def files(self, ctx: HarnessContext) -> dict[str, str]:
        return {f"{ctx.home}/.config/test_curl.json": json.dumps({"base_url": ctx.gateway_url})}

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {"POLAR_URL": ctx.gateway_url, "POLAR_KEY": ctx.key, "POLAR_MODEL": ctx.model_name,
                "POLAR_INSTRUCTION": ctx.instruction, "POLAR_CALLS": str(ctx.config.get("calls", 1)),
                "POLAR_SLEEP": str(ctx.config.get("sleep", 0)), "POLAR_GAP": str(ctx.config.get("gap", 0)),
                "POLAR_EXIT": str(ctx.config.get("exit_code", 0)),
                "POLAR_TOOLS": json.dumps([_BASH_TOOL])}

    def command(self, ctx: HarnessContext) -> list[str]:
        return ["sh", "-c", _SCRIPT]

    def log_paths(self, ctx: HarnessContext) -> list[str]:
        return [f"{ctx.home}/harness.log", f"{ctx.home}/never-written.log"]


class PassEvaluator(Evaluator):
    name = "test_pass"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        ok = ctx.harness_result is not None and ctx.harness_result.ok
        return EvalResult(reward=1.0 if ok else 0.0, passed=ok, details={"traces": len(ctx.trajectory.traces)})


class FreshEvaluator(Evaluator):
    name = "test_fresh"
    needs_fresh_runtime: ClassVar[bool] = True

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        assert ctx.fresh_runtime is not None and ctx.fresh_runtime is not ctx.runtime
        probe = await ctx.fresh_runtime.exec("cat prepared.txt")
        return EvalResult(reward=1.0 if probe.text.strip() == "prepared" else 0.0,
                          details={"fresh": probe.text.strip()})


class SleepyEvaluator(Evaluator):
    name = "test_sleepy"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        assert ctx.runtime is not None
        await ctx.runtime.exec(["sleep", str(self.config.get("seconds", 30))])
        return EvalResult(reward=0.0)


class BrokenEvaluator(Evaluator):
    name = "test_broken"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        raise RuntimeError("the evaluator is broken")


class ScriptedStages(Stages):
    """Sleeps per stage (``metadata.durations[stage]``, default 0.01 s); ``metadata.hold`` names a stage that
    waits for the session's gate (a condition, where a long duration would be a guess about the machine's speed);
    ``metadata.fail`` names a stage that raises. Records teardowns and the peak number of sessions inside each
    stage at once."""

    def __init__(self, prewarm: bool = False) -> None:
        self.prewarm_enabled = prewarm
        self.inside: collections.Counter[str] = collections.Counter()
        self.peak: collections.Counter[str] = collections.Counter()
        self.teardowns: collections.Counter[str] = collections.Counter()
        self.started: list[str] = []
        self.warm = 0  # initialized and not yet torn down or running
        self.peak_warm = 0
        self.gates: dict[str, asyncio.Event] = {}

    def gate(self, session_id: str) -> asyncio.Event:
        """Set it to let ``session_id`` leave the stage its ``metadata.hold`` names."""
        return self.gates.setdefault(session_id, asyncio.Event())

    async def _stage(self, session: Session, stage: str) -> None:
        meta: dict[str, Any] = session.spec.metadata.model_dump()
        self.inside[stage] += 1
        self.peak[stage] = max(self.peak[stage], self.inside[stage])
        try:
            await asyncio.sleep(float((meta.get("durations") or {}).get(stage, 0.01)))
            if meta.get("hold") == stage:
                await self.gate(session.session_id).wait()
            if meta.get("fail") == stage:
                raise RuntimeError(f"{stage} exploded")
        finally:
            self.inside[stage] -= 1

    async def init(self, session: Session) -> None:
        await self._stage(session, "init")
        session.scratch["warm"] = True
        self.warm += 1
        self.peak_warm = max(self.peak_warm, self.warm)

    async def run(self, session: Session) -> None:
        if session.scratch.pop("warm", False):
            self.warm -= 1
        self.started.append(session.session_id)
        await self._stage(session, "run")

    def wants_prewarm(self, session: Session) -> bool:
        return self.prewarm_enabled

    async def prewarm(self, session: Session) -> None:
        await self._stage(session, "prewarm")
        session.scratch["prewarmed"] = True

    async def build(self, session: Session) -> None:
        await self._stage(session, "build")
        session.trajectory = Trajectory(session_id=session.session_id)

    async def evaluate(self, session: Session) -> None:
        await self._stage(session, "evaluate")
        session.evaluation = EvalResult(reward=1.0, details={"prewarmed": session.scratch.get("prewarmed", False)})

    async def teardown(self, session: Session) -> None:
        if session.scratch.pop("warm", False):
            self.warm -= 1
        self.teardowns[session.session_id] += 1

    def live_runtimes(self) -> int:
        return self.warm
