"""``harbor``: run a Harbor task's ``tests/test.sh`` after the agent, the way Harbor's verifier does, and read its
reward from ``/logs/verifier/reward.json`` (first) or ``reward.txt``.

Config (``EvaluatorSpec.config``; ``tasks=harbor`` fills it from the task directory)::

    tests: [{path, data (base64), executable}]   # the task's tests/ directory, uploaded to /tests after the agent
    script: test.sh          # the script under /tests that is run
    timeout: 600             # task.toml's [verifier] timeout_sec
    env: {}                  # task.toml's [verifier] env
    cwd: null                # where it runs; default the runtime's workdir (the Dockerfile's WORKDIR)
    missing_reward: zero     # zero: no or an unreadable reward file scores 0 (the reason in details); error: the
                             # session ends in ERROR instead (Harbor counts it as a verifier failure)

What Harbor does (harbor 0.25.0's Verifier): stale reward files are removed; the tests directory is copied to
``/tests``; ``/tests/test.sh`` is made executable and run from the workdir with its output in
``/logs/verifier/test-stdout.txt``; its exit code is not the reward. ``reward.json`` is an object of named numbers (or
one number) and wins over ``reward.txt`` (one number). Non-numeric values are refused (an unusable file, see
``missing_reward``). With several keys, polar_gym's one reward is the ``reward`` key when present, else their mean;
every key stays in details. A number that is not finite, or beyond ±MAX_REWARD (as every value and the mean must be)
ends the session ERROR with cause ``invalid_reward`` whatever ``missing_reward`` says: the agent can write
``reward.json`` (it wins over the tests' ``reward.txt``), and ``inf`` became ``null`` on the wire.

Reading is careful with what the sandbox wrote: the verifier directory is copied out, then each file is read
without following links, only if it is a regular file under a size cap.
"""

from __future__ import annotations

import base64
import json
import math
import os
import posixpath
import shlex
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from polar_gym.evaluate.base import EvalContext, Evaluator, finite_reward
from polar_gym.evaluate.errors import EvaluationError, EvaluatorConfigError, InvalidReward, MissingRuntimeError
from polar_gym.evaluate.patches import check_ran, output_tail
from polar_gym.runtime.base import ExecStatus, Runtime
from polar_gym.schema import EvalResult

__all__ = ["HarborVerifier", "HarborVerifierConfig", "RewardReading", "TestFile", "read_reward"]

VERIFIER_DIR = "/logs/verifier"
TESTS_DIR = "/tests"
#: a reward file is a number or a small object; anything bigger is not one
MAX_REWARD_BYTES = 64 * 1024


class TestFile(BaseModel):
    __test__ = False
    model_config = ConfigDict(extra="forbid")

    path: str
    data: str = Field(description="the content, base64")
    executable: bool = False


class HarborVerifierConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tests: list[TestFile] = Field(default_factory=list, description="the task's tests/ directory (tasks=harbor "
                                  "fills it), uploaded to /tests after the agent")
    script: str = Field(default="test.sh", description="the script under /tests that is run")
    timeout: float = Field(default=600.0, gt=0, description="seconds the tests may take ([verifier] timeout_sec)")
    env: dict[str, str] = Field(default_factory=dict, description="the tests' environment ([verifier] env)")
    cwd: str | None = Field(default=None, description="where the tests run; default the runtime's workdir")
    missing_reward: Literal["zero", "error"] = Field(
        default="zero", description="no or an unreadable reward file: reward 0 (zero) or the session in ERROR")


@dataclass
class RewardReading:
    """What the verifier directory says: the reward (None when it says nothing usable) and why."""

    reward: float | None
    rewards: dict[str, float] = field(default_factory=dict)
    source: str | None = None
    error: str | None = None
    #: the file holds a number that no reward may be (not finite, or beyond ±MAX_REWARD): an error, never a 0
    invalid: bool = False


def _read_capped(path: Path) -> bytes:
    """The file's bytes: a regular file (a link is refused, never followed) under the size cap."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"{path.name} is a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path.name} is not a regular file")
    if st.st_size > MAX_REWARD_BYTES:
        raise ValueError(f"{path.name} is {st.st_size} bytes (over {MAX_REWARD_BYTES})")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(MAX_REWARD_BYTES + 1)
    if not data.strip():
        raise ValueError(f"{path.name} is empty")
    return data


def _number(value: Any, what: str) -> float:
    """A value of a reward file as a reward: ValueError when it is not a number, InvalidReward when it is one no
    reward may be."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} is not a number: {str(value)[:80]!r}")
    return finite_reward(value, f"{what} is")


def _mean(rewards: dict[str, float]) -> float:
    """The mean, summed after dividing so that large values do not overflow on the way (1e308 + 1e308 was inf)."""
    return finite_reward(math.fsum(v / len(rewards) for v in rewards.values()),
                         f"the mean of reward.json's {len(rewards)} values is")


def read_reward(verifier_dir: Path) -> RewardReading:
    """The reward in a copy of ``/logs/verifier``: reward.json (an object of numbers, or one number) first, else
    reward.txt (one number). Never raises: a missing or invalid file is a reading with ``error`` set."""
    for name in ("reward.json", "reward.txt"):
        path = verifier_dir / name
        if not os.path.lexists(path):
            continue
        try:
            data = _read_capped(path)
            if name == "reward.txt":
                try:
                    value = float(data.decode("utf-8").strip())
                except (UnicodeDecodeError, ValueError):
                    raise ValueError(f"reward.txt is not a number: {data[:80]!r}") from None
                value = _number(value, "reward.txt")
                return RewardReading(reward=value, rewards={"reward": value}, source=name)
            try:
                parsed = json.loads(data)
            except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: [[[[... nested deep
                raise ValueError(f"reward.json is not JSON: {str(exc)[:200]}") from None
            if isinstance(parsed, dict):
                if not parsed:
                    raise ValueError("reward.json is an empty object")
                rewards = {str(k): _number(v, f"reward.json[{k!r}]") for k, v in parsed.items()}
            else:
                rewards = {"reward": _number(parsed, "reward.json")}
            reward = rewards["reward"] if "reward" in rewards else _mean(rewards)
            return RewardReading(reward=reward, rewards=rewards, source=name)
        except InvalidReward as exc:
            return RewardReading(reward=None, source=name, error=str(exc), invalid=True)
        except (OSError, ValueError) as exc:
            return RewardReading(reward=None, source=name, error=str(exc))
    return RewardReading(reward=None, error=f"no reward file ({VERIFIER_DIR}/reward.json or reward.txt)")


class HarborVerifier(Evaluator):
    name: ClassVar[str] = "harbor"
    config_model: ClassVar[type[BaseModel]] = HarborVerifierConfig

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        try:
            self.options = HarborVerifierConfig.model_validate(self.config)
        except ValidationError as exc:
            raise EvaluatorConfigError(f"harbor config: {exc}") from exc

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        runtime = ctx.fresh_runtime if self.wants_fresh_runtime(ctx.spec.evaluator) else ctx.runtime
        if runtime is None:
            raise MissingRuntimeError("harbor needs the session's runtime to run the task's tests in")
        opts = self.options
        script = posixpath.join(TESTS_DIR, opts.script)
        # stale rewards go, and whatever the agent left in /tests (a conftest.py the tests would pick up)
        reset = (f"rm -f {VERIFIER_DIR}/reward.txt {VERIFIER_DIR}/reward.json && mkdir -p {VERIFIER_DIR} "
                 f"/logs/agent {TESTS_DIR} && find {TESTS_DIR}/ -mindepth 1 -delete")
        cleared = check_ran(await runtime.exec(reset, timeout=60), "clearing the verifier directory")
        if not cleared.ok:  # the environment, not the agent: Harbor mounts these directories itself
            raise EvaluationError(f"could not prepare {VERIFIER_DIR} and {TESTS_DIR}: "
                                  f"{output_tail(cleared.stderr or cleared.stdout)}")
        for test in opts.tests:
            await runtime.upload(base64.b64decode(test.data), posixpath.join(TESTS_DIR, test.path))
        run = f"chmod +x {shlex.quote(script)}; ({shlex.quote(script)}) > {VERIFIER_DIR}/test-stdout.txt 2>&1"
        result = check_ran(await runtime.exec(run, cwd=opts.cwd, env=opts.env or None, timeout=opts.timeout),
                           "the task's tests")
        details: dict[str, Any] = {"status": result.status.value, "exit_code": result.exit_code,
                                   "seconds": round(result.seconds, 3)}
        reading, stdout = await _collect(runtime)
        details.update(output=output_tail(stdout), reward_file=reading.source, rewards=reading.rewards)
        if result.status is ExecStatus.TIMEOUT:
            details["reason"] = f"the tests timed out after {opts.timeout:g}s"
            return EvalResult(reward=0.0, passed=False, details=details)
        if reading.invalid:  # a number no reward may be: an error whatever missing_reward says
            raise InvalidReward(f"the task's tests left {reading.error}")
        if reading.reward is None:
            reason = reading.error or "no reward"
            if opts.missing_reward == "error":
                raise EvaluationError(f"the task's tests left no usable reward: {reason}")
            details["reason"] = reason
            return EvalResult(reward=0.0, passed=False, details=details)
        details["reason"] = f"reward from {reading.source}"
        return EvalResult(reward=reading.reward, passed=reading.reward >= 1.0, details=details)


async def _collect(runtime: Runtime) -> tuple[RewardReading, bytes]:
    """Copy ``/logs/verifier`` out and read it (links kept as links, so nothing the sandbox planted is followed)."""
    with tempfile.TemporaryDirectory(prefix="polar-harbor-") as tmp:
        target = Path(tmp) / "verifier"
        try:
            await runtime.download(VERIFIER_DIR, target)
        except FileNotFoundError:
            return RewardReading(reward=None, error=f"{VERIFIER_DIR} does not exist"), b""
        except Exception as exc:  # the runtime refused the copy (a link out of its writable area)
            return RewardReading(reward=None, error=f"{VERIFIER_DIR} could not be copied out: {exc}"), b""
        stdout = b""
        try:
            stdout = _read_log(target / "test-stdout.txt")
        except OSError:
            pass
        return read_reward(target), stdout


def _read_log(path: Path, limit: int = 256 * 1024) -> bytes:
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        return b""
    with open(path, "rb") as handle:
        handle.seek(max(0, st.st_size - limit))
        return handle.read(limit)
