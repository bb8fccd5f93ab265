"""The real stage functions: runtimes from ``RUNTIMES``, harness adapters from ``HARNESSES``, the proxy's journal,
builders from ``BUILDERS`` and evaluators from ``EVALUATORS``.

Per dispatch attempt, under ``<workdir>/<session id>/<attempt id>/``: ``sandbox/`` (the runtime's session directory,
``/polar`` inside), ``eval/`` (the fresh evaluation runtime's, when prewarmed), ``artifacts/`` (harness stdout/stderr,
its logs, ``result.json``), which the sandbox cannot write, and ``owner.json`` (which gateway process runs it).

Clean restarts: every POST /sessions is a new attempt with its own workspace and journal stream, so a session retried
after its gateway was killed never sees the dead attempt's files or calls. A dead attempt's directory (its owner
process is gone) is removed when a new attempt of the session starts, and at the gateway's first session after
start-up if it never finished; its journal stream stays on disk and is reported in ``earlier_attempts``, not trained.

Secrets: the harness gets a fresh key (:func:`~polar_gym.proxy.service.new_session_key`), served by the proxy only
while the session is RUNNING; the key is in the harness's env and its config files under HOME (the session dir),
never in the result, the artifacts or the logs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import posixpath
import re
import shutil
import socket
from pathlib import Path
from typing import Any

from polar_gym.causes import HARNESS_NOT_RUN, INVALID_REWARD, STDERR_TAIL
from polar_gym.dirnames import dirname_for
from polar_gym.evaluate.base import EvalContext, Evaluator, checked_evaluation
from polar_gym.evaluate.errors import InvalidReward
from polar_gym.evaluate.judge import JudgeBatcher, JudgeError
from polar_gym.gateway.config import GatewayConfig
from polar_gym.gateway.errors import PrepareFailed, StageError
from polar_gym.gateway.session import Session
from polar_gym.gateway.sizing import NodePressure
from polar_gym.gateway.stages import Stages
from polar_gym.harness.base import Harness, HarnessContext
from polar_gym.harness.pyinstall import InstalledCli, installed_cli
from polar_gym.journal import call_log_entry
from polar_gym.merge import apply_rewards, build_trajectory
from polar_gym.private_files import private_dir, write_secret
from polar_gym.proxy.service import CallFailures, ProxyService, SessionInfo, new_session_key
from polar_gym.registry import EVALUATORS, HARNESSES, RUNTIMES, RegistryError
from polar_gym.runtime.base import SESSION_MOUNT, ExecResult, ExecStatus, Runtime, request_option_error
from polar_gym.runtime.errors import RuntimeOptionError
from polar_gym.schema import BuilderSpec, CompletionSession, PrepareAction, SessionResult, SessionSpec, Trajectory
from polar_gym.tasks.prepare import PrepareError, upload_host_source

__all__ = ["OWNER_FILE", "SandboxStages", "clean_dead_attempts", "safe_name"]

log = logging.getLogger("polar_gym.gateway")

#: where HOME is inside every sandbox (the session mount keeps it writable and per-session)
HOME = f"{SESSION_MOUNT}/home"
_TAIL = 2000
_ATTEMPT_RE = re.compile(r"^[0-9a-f]{12}$")
OWNER_FILE = "owner.json"
#: attempts running in this process, over every SandboxStages in it (never cleaned as stale)
_LIVE_ATTEMPTS: set[Path] = set()


def safe_name(session_id: str) -> str:
    """A directory name for a session id (ids are caller-chosen: no path tricks, no two ids share one)."""
    return dirname_for(session_id)


def _memory_available_mb() -> float | None:
    """The host's MemAvailable, or less when this process's cgroup (a Slurm job's, a container's) has a limit."""
    available: float | None = None
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    available = int(line.split()[1]) / 1024
                    break
        with open("/proc/self/cgroup", "rb") as f:
            group = next((ln.split(b":", 2)[2].strip() for ln in f if ln.startswith(b"0::")), None)
        if group is not None:
            base = Path("/sys/fs/cgroup") / group.decode().lstrip("/")
            limit = (base / "memory.max").read_text().strip()
            if limit != "max":
                left = (int(limit) - int((base / "memory.current").read_text())) / 2**20
                available = left if available is None else min(available, left)
    except (OSError, ValueError, IndexError):
        pass
    return available


def _disk_free_mb(directory: Path) -> float | None:
    for candidate in (directory, *directory.absolute().parents):
        try:
            return shutil.disk_usage(candidate).free / 2**20
        except OSError:
            continue
    return None


def _tail(data: bytes) -> str:
    return data[-_TAIL:].decode(errors="replace").strip()


class SandboxStages(Stages):
    def __init__(self, service: ProxyService, config: GatewayConfig) -> None:
        self.service = service
        self.config = config
        self._live: set[Runtime] = set()
        self._startup_clean: asyncio.Task[list[str]] | None = None
        self._startup_cleaned: list[str] | None = None
        self.judges = {name: JudgeBatcher(endpoint) for name, endpoint in config.judges.items()}
        self._calls_seen = (0, 0)  # (model_calls_timed, model_call_ms) at the last pressure reading

    # -- plug-ins ---------------------------------------------------------------------------------------------

    @staticmethod
    def _harness(spec: SessionSpec) -> Harness:
        try:
            return HARNESSES.get(spec.agent.harness)()  # type: ignore[no-any-return]
        except RegistryError as exc:
            raise StageError("init", str(exc)) from exc

    @staticmethod
    def _evaluator_cls(spec: SessionSpec) -> type[Evaluator]:
        try:
            return EVALUATORS.get(spec.evaluator.strategy)  # type: ignore[no-any-return]
        except RegistryError as exc:
            raise StageError("init", str(exc)) from exc

    def _builder_spec(self, spec: SessionSpec) -> BuilderSpec:
        """The spec's builder, with end-of-turn IDs defaulting to the engine tokenizer's (as the proxy's route)."""
        options = dict(spec.builder.config)
        eot = self.service.engine.end_of_turn_ids
        if eot and "end_of_turn_ids" not in options:
            options["end_of_turn_ids"] = list(eot)
        return BuilderSpec(strategy=spec.builder.strategy, config=options)

    def _runtime(self, spec: SessionSpec, directory: Path, harness: Harness | None = None) -> Runtime:
        """The session's runtime. Options that reach the host (a CLI, a binary, host paths) come only from this
        gateway's configuration (``runtime_options``, ``expose_roots``, the harness install); a request naming
        one is refused here, before anything runs (issue 11, fault 3)."""
        try:
            backend = RUNTIMES.get(spec.runtime.backend)
        except RegistryError as exc:
            raise StageError("init", str(exc)) from exc
        if not (isinstance(backend, type) and issubclass(backend, Runtime)):
            raise StageError("init", f"runtime backend {spec.runtime.backend!r} is not a Runtime")
        refused = request_option_error(backend, spec.runtime.options)
        if refused is not None:
            raise StageError("init", refused)
        options = dict(self.config.runtime_options)
        if self.config.expose_roots and "expose" in backend.request_options:
            options.setdefault("expose_roots", [str(root) for root in self.config.expose_roots])
        install = _harness_install(harness, spec) if harness is not None else None
        if install is not None:  # the local sandbox sees no host directory it is not given: bind the pinned CLI
            options["ro_binds"] = {**dict(options.get("ro_binds") or {}), **{str(p): str(p) for p in install.binds}}
        runtime_spec = spec.runtime
        floor = harness.min_memory_mb if harness is not None else None
        asked = runtime_spec.memory_mb
        if floor and ((asked is None and "memory_mb" not in options) or (asked is not None and 0 < asked < floor)):
            # a task's memory_mb sizes its environment, the default sizes a small CLI: a harness that cannot run
            # below its floor gets the floor (the operator's own default stands; it is theirs to size)
            runtime_spec = runtime_spec.model_copy(update={"memory_mb": floor})
        try:
            runtime: Runtime = backend(runtime_spec, directory, gateway=self.config.endpoint, options=options or None)
        except RuntimeOptionError as exc:
            raise StageError("init", str(exc)) from exc
        return runtime

    async def _start(self, runtime: Runtime) -> None:
        self._live.add(runtime)  # before start: a start cut short by cancellation is still stopped at teardown
        await runtime.start()

    def live_runtimes(self) -> int:
        return len(self._live)

    def pressure(self) -> NodePressure:
        """Available memory (/proc/meminfo), free disk under the work directory, and the model calls answered since
        the last reading with their mean time."""
        stats = self.service.stats
        calls, ms = stats.get("model_calls_timed", 0), stats.get("model_call_ms", 0)
        new_calls, new_ms = calls - self._calls_seen[0], ms - self._calls_seen[1]
        self._calls_seen = (calls, ms)
        return NodePressure(memory_available_mb=_memory_available_mb(), disk_free_mb=_disk_free_mb(self.config.workdir),
                            model_call_seconds=new_ms / 1000 / new_calls if new_calls > 0 else None,
                            model_calls=max(0, new_calls))

    def registered(self, s: Session) -> None:
        # A restarted gateway's journal still names the dead attempt on disk until INIT writes the new pointer,
        # and INIT may wait for a slot: until then the session's captures read as the dead attempt's.
        self.service.journal.mark_latest(s.spec.session_id, s.attempt_id)

    # -- INIT --------------------------------------------------------------------------------------------------

    async def init(self, s: Session) -> None:
        spec = s.spec
        harness = self._harness(spec)
        s.scratch["evaluator_cls"] = self._evaluator_cls(spec)
        s.scratch["harness"] = harness
        await self._clean_after_restart()
        root = self.config.workdir / safe_name(spec.session_id)
        s.session_dir = root / s.attempt_id
        _LIVE_ATTEMPTS.add(s.session_dir)
        artifacts = s.session_dir / "artifacts"
        removed = await asyncio.to_thread(_open_attempt, s.session_dir, artifacts)
        if removed:
            s.artifacts["removed_stale_attempts"] = removed
        await self.service.journal.begin_attempt(spec.session_id, s.attempt_id)
        s.artifacts["dir"] = str(artifacts)
        s.runtime = self._runtime(spec, s.session_dir / "sandbox", harness)
        await self._start(s.runtime)
        await self._prepare(s.runtime, spec.runtime.prepare, s)
        key = new_session_key()  # served only while RUNNING; never stored in the result or the artifacts
        ctx = HarnessContext(session_id=spec.session_id, instruction=spec.instruction,
                             model_name=spec.agent.model_name, gateway_url=s.runtime.gateway_url,
                             workdir=spec.runtime.workdir, home=HOME, cli_path=_cli_path(harness, spec),
                             config=dict(spec.agent.config), api_key=key)
        s.scratch["harness_ctx"] = ctx
        for path, content in harness.files(ctx).items():
            await s.runtime.upload(content.encode(), path)

    async def _clean_after_restart(self) -> None:
        """Once per gateway process, before its first session: remove attempts that a dead gateway left unfinished
        under the workdir (in a thread; later sessions do not wait for it again)."""
        if self._startup_clean is None:
            self._startup_clean = asyncio.create_task(asyncio.to_thread(clean_dead_attempts, self.config.workdir))
        try:
            removed = await asyncio.shield(self._startup_clean)
        except Exception:
            log.warning("could not clean dead attempts under %s", self.config.workdir, exc_info=True)
            return
        if removed and self._startup_cleaned is None:
            self._startup_cleaned = removed
            log.info("removed %d unfinished attempt directories of a dead gateway under %s", len(removed),
                     self.config.workdir)

    async def _prepare(self, runtime: Runtime, actions: list[PrepareAction], s: Session) -> None:
        for i, action in enumerate(actions):
            what = f"prepare action {i} ({action.type})"
            if action.type == "exec":
                assert action.command is not None
                timeout = s.remaining() if action.timeout_seconds is None else min(action.timeout_seconds,
                                                                                   s.remaining())
                result = await runtime.exec(action.command, env={"HOME": HOME}, timeout=timeout)
                if not result.ok:
                    detail = _tail(result.stderr) or _tail(result.stdout) or result.reason or ""
                    code = f"exit code {result.exit_code}" if result.exit_code is not None else result.status.value
                    raise PrepareFailed("init", f"{what} {action.command!r} failed ({code}): {detail}")
            elif action.content is not None:
                assert action.dst is not None
                await runtime.upload(action.content.encode(), action.dst)
            else:  # a host path named by the request: only under the operator's roots, read as a task's files are
                try:
                    await upload_host_source(runtime, action, self.config.expose_roots)
                except (ValueError, PrepareError) as exc:  # under no root; a link out, a FIFO, a file over the caps
                    raise PrepareFailed("init", f"{what}: {exc} (GatewayConfig.expose_roots, --expose-root)") from None

    # -- RUNNING -----------------------------------------------------------------------------------------------

    def wants_prewarm(self, s: Session) -> bool:
        cls = s.scratch.get("evaluator_cls")
        return bool(s.spec.evaluator.refresh_runtime or getattr(cls, "needs_fresh_runtime", False))

    async def prewarm(self, s: Session) -> None:
        assert s.session_dir is not None
        await asyncio.to_thread(_make_dirs, s.session_dir / "eval")
        s.eval_runtime = self._runtime(s.spec, s.session_dir / "eval")
        await self._start(s.eval_runtime)
        await self._prepare(s.eval_runtime, s.spec.runtime.prepare, s)

    def _register(self, s: Session) -> None:
        spec = s.spec
        ctx: HarnessContext = s.scratch["harness_ctx"]
        metadata = spec.metadata.model_dump()
        self.service.engine.open_session(spec.session_id, metadata)  # a bad oracle script fails before the key
        self.service.sessions.register(SessionInfo(spec.session_id, spec.agent.model_name, metadata,
                                                   attempt=s.attempt_id, key=ctx.api_key))

    def _revoke(self, session_id: str) -> None:
        """The session's key stops working (a later call gets a 401; its captures need the admin token)."""
        self.service.sessions.unregister(session_id, forget=False)

    def _unregister(self, session_id: str) -> None:
        self.service.sessions.unregister(session_id)
        self.service.forget(session_id)

    async def run(self, s: Session) -> None:
        assert s.runtime is not None and s.session_dir is not None
        harness: Harness = s.scratch["harness"]
        ctx: HarnessContext = s.scratch["harness_ctx"]
        self._register(s)
        env = {"HOME": HOME, **harness.env(ctx)}
        try:
            s.harness_result = result = await s.runtime.exec(harness.command(ctx), env=env, timeout=s.remaining())
        finally:
            self._revoke(s.session_id)  # the key lives exactly as long as the RUNNING stage
        if result.oom_kills:  # a harness may lose a worker to the limit and still exit 0 (metadata.harness has it)
            log.warning("session %s: the kernel's OOM killer ended %d process(es) of its sandbox at its memory limit "
                        "while the harness ran (runtime memory_mb)", s.session_id, result.oom_kills)
        artifacts = s.session_dir / "artifacts"
        await asyncio.to_thread(_write_outputs, artifacts, result.stdout, result.stderr)
        if not result.ok and result.stderr:  # travels with the result: the session dir may be node-local scratch
            s.artifacts[STDERR_TAIL] = result.stderr[-STDERR_TAIL_BYTES:].decode("utf-8", "replace")
        kept, missing = [], []
        for path in harness.log_paths(ctx):
            target = artifacts / "logs" / safe_name(posixpath.normpath(path).strip("/").replace("/", "__"))
            try:
                async with asyncio.timeout(self.config.log_collect_timeout_seconds):
                    await s.runtime.download(path, target)
                kept.append(str(target))
            except Exception as exc:  # a missing log is worth noting, not worth failing the session
                missing.append(f"{path}: {exc.__class__.__name__}: {exc}")
        s.artifacts["logs"] = kept
        if missing:
            s.artifacts["missing_logs"] = missing

    # -- POSTRUN -----------------------------------------------------------------------------------------------

    async def build(self, s: Session) -> None:
        self._revoke(s.session_id)  # no new model calls count once the harness is done (revoked after RUN already)
        # a call the harness made just before it ended (or was killed) may still be on its way to the journal
        if not await self.service.wait_idle(s.session_id, self.config.settle_timeout_seconds):
            s.artifacts["unsettled_calls"] = "model calls were still in flight when the trajectory was built"
        self._unregister(s.session_id)
        journal = self.service.journal
        records = await journal.records(s.session_id, s.attempt_id)
        _note_call_failures(s, self.service.take_call_failures(s.session_id))
        session = CompletionSession(session_id=s.session_id, completions=records,
                                    metadata={"task_id": s.spec.task_id, "sample_index": s.spec.sample_index,
                                              "attempt_id": s.attempt_id})
        s.artifacts["completions"] = len(records)
        s.artifacts["call_log"] = [call_log_entry(r) for r in records]  # the journal may stay on this node
        _note_harness_not_run(s, s.harness_result, len(records))
        earlier = {a: n for a, n in (await journal.attempts(s.session_id)).items() if a != s.attempt_id}
        if earlier:  # calls of dead attempts: reported, never trained
            s.artifacts["earlier_attempts"] = earlier
        s.trajectory = await asyncio.to_thread(build_trajectory, session, self._builder_spec(s.spec))

    async def evaluate(self, s: Session) -> None:
        assert s.trajectory is not None
        if "error_cause" in s.artifacts:  # the model never answered: a score would read as the policy's
            return
        cls = s.scratch.get("evaluator_cls") or self._evaluator_cls(s.spec)
        evaluator = cls(s.spec.evaluator.config.model_dump())
        ctx = EvalContext(spec=s.spec, trajectory=s.trajectory, harness_result=s.harness_result, runtime=s.runtime,
                          fresh_runtime=s.eval_runtime, artifacts=s.artifacts, judges=self.judges)
        try:
            s.evaluation = evaluation = await checked_evaluation(evaluator, ctx)
        except (InvalidReward, JudgeError) as exc:  # not a 0: a broken verifier or judge says nothing of the policy
            cause = exc.cause if isinstance(exc, JudgeError) else INVALID_REWARD
            s.artifacts["error_cause"] = cause
            s.problem = f"{cause}: {exc}" if s.problem is None else f"{cause}: {exc}; {s.problem}"
            return
        trajectory: Trajectory = s.trajectory
        s.trajectory = await asyncio.to_thread(apply_rewards, trajectory, evaluation)

    async def teardown(self, s: Session) -> None:
        self._unregister(s.session_id)
        self.service.take_call_failures(s.session_id)  # a session cancelled before POSTRUN: forget its count
        for runtime in (s.runtime, s.eval_runtime):
            if runtime is None:
                continue
            try:
                await runtime.stop()
            except Exception:
                log.exception("stopping a runtime of session %s failed", s.session_id)
            finally:
                self._live.discard(runtime)

    async def finished(self, s: Session, result: SessionResult) -> None:
        try:
            if s.session_dir is not None:
                body = result.model_dump_json(indent=1)
                await asyncio.to_thread(_write_text, s.session_dir / "artifacts" / "result.json", body)
        finally:
            # the result is final: nothing of this attempt needs to stay in memory (its journal is on disk)
            self.service.journal.release(s.session_id, s.attempt_id)
            self.service.forget(s.session_id)
            if s.session_dir is not None:
                _LIVE_ATTEMPTS.discard(s.session_dir)


def _note_call_failures(s: Session, failures: CallFailures | None) -> None:
    """Model calls that failed for infrastructure reasons (upstream unreachable, 5xx, timeout) go into the result's
    artifacts (``model_call_failures``). The rule: when no call succeeded after the last such failure, the harness
    ran without a model, so the session ends ERROR with the cause first in its reason (``error_cause`` names it)
    and is not scored; a failure the harness got past (a later call succeeded) only counts."""
    if failures is None:
        return
    s.artifacts["model_call_failures"] = failures.summary()
    if failures.recovered:
        return
    s.artifacts["error_cause"] = failures.last_cause
    problem = (f"{failures.last_error} ({failures.failed} model call(s) failed for infrastructure reasons, "
               f"none succeeded after the last)")
    s.problem = problem if s.problem is None else f"{problem}; {s.problem}"


#: the exit codes of a command that could not start: not executable (126), not found (127); the sandbox's relay, sh,
#: env and the container engines all answer so
_NOT_STARTED = (126, 127)


def _note_harness_not_run(s: Session, result: ExecResult | None, completions: int) -> None:
    """A harness whose command exited 126 or 127 before any model call never ran (its CLI is not installed where
    the sandbox looks, or not executable): the session ends ERROR with the infrastructure cause ``harness_not_run``
    (the exit code and the end of its stderr in the reason), not COMPLETED with a reward 0 that says nothing of the
    policy. A harness that made a call ran, whatever it exited with; a cause already named (its upstream failed)
    stays."""
    if (result is None or result.status is not ExecStatus.FAILED or result.exit_code not in _NOT_STARTED
            or completions or "error_cause" in s.artifacts):
        return
    s.artifacts["error_cause"] = HARNESS_NOT_RUN
    tail = " / ".join(line.strip() for line in _tail(result.stderr).splitlines()[-3:] if line.strip())
    problem = (f"{HARNESS_NOT_RUN}: the harness command exited {result.exit_code} before any model call (its CLI is "
               f"not installed or not executable where the sandbox looks); stderr: {tail[-300:] or '(empty)'}")
    s.problem = problem if s.problem is None else f"{problem}; {s.problem}"


def _cli_path(harness: Harness, spec: SessionSpec) -> str | None:
    """The harness binary: ``agent.config["cli_path"]`` if given; in the ``local`` sandbox the pinned install from
    set-up (bound read-only at the same path, see :func:`_harness_install`); elsewhere None (the image has it on
    PATH)."""
    given = spec.agent.config.get("cli_path")
    if given:
        return str(given)
    install = _harness_install(harness, spec)
    return str(install.binary) if install is not None else None


def _harness_install(harness: Harness, spec: SessionSpec) -> InstalledCli | None:
    """The pinned harness install (npm or Python) the ``local`` sandbox needs bound (None: not local, no pin, not
    installed, or the request names its own CLI)."""
    if spec.runtime.backend != "local" or harness.pin is None or spec.agent.config.get("cli_path"):
        return None
    return installed_cli(harness.pin, cache_root=os.environ.get("POLAR_CACHE"))


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), so a reused pid is not taken for its owner."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _owner() -> dict[str, Any]:
    return {"pid": os.getpid(), "start": _process_start(os.getpid()), "host": socket.gethostname()}


def _owner_alive(attempt_dir: Path) -> bool:
    """Whether the gateway process that owns an attempt directory still runs. Unknown hosts count as alive (a
    shared workdir of several nodes is not ours to clean); a directory without an owner file is a dead start."""
    try:
        owner = json.loads((attempt_dir / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname():
        return isinstance(owner, dict)
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return False
    start = _process_start(pid)
    return start is not None and (owner.get("start") is None or owner.get("start") == start)


def _stale(attempt_dir: Path) -> bool:
    if attempt_dir in _LIVE_ATTEMPTS or not _ATTEMPT_RE.match(attempt_dir.name) or not attempt_dir.is_dir():
        return False
    owner_is_us = False
    try:
        owner_is_us = json.loads((attempt_dir / OWNER_FILE).read_text()).get("pid") == os.getpid()
    except (OSError, ValueError, AttributeError):
        pass
    return owner_is_us or not _owner_alive(attempt_dir)


def _open_attempt(attempt_dir: Path, artifacts: Path) -> list[str]:
    """Create the attempt's directories and owner file; remove the session's stale attempts (their owner is dead,
    or they are this process's finished ones). Returns the removed attempt ids."""
    removed = []
    if attempt_dir.parent.is_dir():
        for other in sorted(attempt_dir.parent.iterdir()):
            if other != attempt_dir and _stale(other):
                shutil.rmtree(other, ignore_errors=True)
                removed.append(other.name)
    _make_dirs(attempt_dir / "sandbox")  # its mode is the runtime's business (a container's user must reach it)
    private_dir(artifacts)
    # only the gateway's user reaches inside: a sandbox's files (its uid owns every session's) and its copied-out
    # logs are nobody else's business, and a file it planted must not be reachable by another user of the host
    for path in (attempt_dir.parent, attempt_dir):  # not the workdir itself: it may be shared (/tmp)
        path.chmod(0o700)
    _write_text(attempt_dir / OWNER_FILE, json.dumps(_owner()))
    return removed


def clean_dead_attempts(workdir: Path) -> list[str]:
    """Remove attempt directories whose gateway died before their result was written (``<session>/<attempt>``
    paths). Finished attempts keep their artifacts; live ones (of any running gateway) are left alone."""
    removed: list[str] = []
    if not workdir.is_dir():
        return removed
    for session_dir in workdir.iterdir():
        if not session_dir.is_dir():
            continue
        for attempt_dir in session_dir.iterdir():
            if (_ATTEMPT_RE.match(attempt_dir.name) and attempt_dir not in _LIVE_ATTEMPTS
                    and not (attempt_dir / "artifacts" / "result.json").exists() and not _owner_alive(attempt_dir)):
                shutil.rmtree(attempt_dir, ignore_errors=True)
                removed.append(f"{session_dir.name}/{attempt_dir.name}")
    return removed


#: bytes of a failed harness's stderr its result carries (``artifacts.harness_stderr_tail``)
STDERR_TAIL_BYTES = 2000


def _make_dirs(*paths: Path) -> None:
    for path in paths:
        path.mkdir(parents=True, exist_ok=True)


def _write_outputs(artifacts: Path, stdout: bytes, stderr: bytes) -> None:
    private_dir(artifacts)  # what the harness printed holds prompts and completions: the owner's only
    write_secret(artifacts / "harness.stdout", stdout)
    write_secret(artifacts / "harness.stderr", stderr)


def _write_text(path: Path, text: str) -> None:
    """An artifact (result.json, the owner file): the owner's only, like the rest of a run's files."""
    write_secret(path, text)

