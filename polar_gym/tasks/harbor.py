"""Harbor task directories read as TaskRequests (``tasks=harbor``).

A Harbor task (PyPI ``harbor``; Terminal-Bench style) is a directory: ``task.toml`` (timeouts, resources),
``instruction.md`` (what the agent gets), ``environment/Dockerfile`` (+ build context; the agent works in its
WORKDIR), ``tests/test.sh`` (run after the agent from the workdir, with the tests at ``/tests``; it writes the reward
to ``/logs/verifier/reward.txt`` or ``reward.json``) and ``solution/solve.sh`` (what Harbor's oracle runs from
``/solution``). Here the environment becomes the session's runtime (an image on runtime=docker; on runtime=local the
Dockerfile's simple subset replayed in the sandbox, :mod:`polar_gym.tasks.dockerfile`), the ``harbor`` evaluator runs
the tests the way Harbor's verifier does, and the oracle engine plays the solution as one shell command. Sibling
directories ``solution-<name>/`` (the same layout: ``solution-wrong/solve.sh``) are alternative solutions, oracle
variants named ``<name>`` (:mod:`polar_gym.tasks.forks`): sample i of the task plays the reference or a variant,
round robin.

Files travel inside the request (the tests in the evaluator's config, the solution in the oracle script), so a
gateway on another node needs no access to the task directory.

A task is untrusted input: every file is read through :class:`polar_gym.tasks.files.TaskFiles` (no link out of the
task directory, no FIFO / device / socket, every read bounded), and a task's ``env`` may not set a name a dynamic
loader or container engine reads (:func:`polar_gym.schema.host_read_env_names`).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import itertools
import logging
import os
import posixpath
import re
import shlex
import tarfile
import tomllib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from polar_gym.schema import (
    ORACLE_NAME_PATTERN,
    EvaluatorSpec,
    OracleScript,
    RuntimeSpec,
    TaskMetadata,
    TaskRequest,
    host_read_env_names,
)
from polar_gym.settings import ConfigError
from polar_gym.tasks.dockerfile import UnsupportedDockerfile, local_environment, parse_dockerfile
from polar_gym.tasks.files import MAX_TASK_ENTRIES, TaskFiles
from polar_gym.tasks.refused import RefusedTask

__all__ = [
    "HARBOR_LINKS",
    "VARIANT_PREFIX",
    "HarborTask",
    "HarborTaskConfig",
    "find_tasks",
    "load_task",
    "pack_files",
    "refusal",
    "scan_tasks",
    "solution_command",
    "solution_variants",
]

log = logging.getLogger(__name__)

#: where Harbor puts things in the environment; on runtime=local they are links into the session directory
HARBOR_LINKS = {"/logs": "/polar/harbor/logs", "/tests": "/polar/harbor/tests", "/solution": "/polar/harbor/solution"}
_HARBOR_DIRS = ("/logs", "/logs/verifier", "/logs/agent", "/tests", "/solution")
#: a tests or solution directory bigger than this belongs in the image
MAX_PACKED_BYTES = 8 * 1024 * 1024
Solution = Literal["reference", "none"]
#: an alternative solution (an oracle variant, polar_gym.tasks.forks) is a sibling directory ``solution-<name>/``
VARIANT_PREFIX = "solution-"
_REFERENCE_ANSWER = "Ran the reference solution (solution/solve.sh)."


class _Section(BaseModel):
    """Harbor's sections carry more keys than polar_gym uses; the rest are kept, not refused."""

    model_config = ConfigDict(extra="allow")


class VerifierSection(_Section):
    timeout_sec: float = Field(default=600.0, gt=0)
    env: dict[str, str] = Field(default_factory=dict)


class AgentSection(_Section):
    timeout_sec: float | None = Field(default=None, gt=0)


class EnvironmentSection(_Section):
    build_timeout_sec: float = Field(default=600.0, gt=0)
    docker_image: str | None = None
    os: str = "linux"
    cpus: float | None = Field(default=None, gt=0)
    memory_mb: int | None = Field(default=None, gt=0)
    storage_mb: int | None = Field(default=None, gt=0)
    workdir: str | None = None
    env: dict[str, str] = Field(default_factory=dict)


class SolutionSection(_Section):
    env: dict[str, str] = Field(default_factory=dict)


class HarborTaskConfig(_Section):
    """``task.toml``: the keys polar_gym uses, typed; Harbor's others kept as they are."""

    schema_version: str = "1.0"
    metadata: dict[str, Any] = Field(default_factory=dict)
    verifier: VerifierSection = Field(default_factory=VerifierSection)
    agent: AgentSection = Field(default_factory=AgentSection)
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)
    solution: SolutionSection = Field(default_factory=SolutionSection)
    steps: list[dict[str, Any]] | None = None

    @classmethod
    def from_toml(cls, text: str) -> HarborTaskConfig:
        data = tomllib.loads(text)
        if "version" in data:  # the older key, as Harbor reads it
            data.setdefault("schema_version", str(data.pop("version")))
        return cls.model_validate(data)


def _packed(directory: Path | TaskFiles) -> list[tuple[str, bytes, bool]]:
    """(path, bytes, executable) of every regular file under ``directory``, read as task files: links inside it are
    left out (never followed), the total is capped (:data:`MAX_PACKED_BYTES`)."""
    files = directory if isinstance(directory, TaskFiles) else TaskFiles(directory)
    entries = [e for e in files.walk(max_file=MAX_PACKED_BYTES) if e.link is None]
    if sum(e.size for e in entries) > MAX_PACKED_BYTES:
        raise ValueError(f"{files.task}: {files.root} holds over {MAX_PACKED_BYTES // 2**20} MiB")
    return [(e.rel, files.read_entry(e, limit=MAX_PACKED_BYTES), e.executable)
            for e in sorted(entries, key=lambda e: PurePosixPath(e.rel).parts)]


def pack_files(directory: Path | TaskFiles) -> list[dict[str, Any]]:
    """Every regular file under ``directory`` as ``{"path", "data" (base64), "executable"}``; symlinks are left out
    and the total is capped (:data:`MAX_PACKED_BYTES`)."""
    return [{"path": rel, "data": base64.b64encode(data).decode(), "executable": executable}
            for rel, data, executable in _packed(directory)]


def _plain(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """The same bytes for the same files: no times, owners or host modes besides the executable bit."""
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
    info.mode = 0o755 if info.mode & 0o111 else 0o644
    return info


def solution_command(solution_dir: Path | TaskFiles, script: str = "solve.sh",
                     env: dict[str, str] | None = None) -> str:
    """One POSIX command that recreates the solution directory at ``/solution`` and runs its script from the
    current directory, as Harbor's oracle does. The files travel as a base64 tarball (only ``[A-Za-z0-9+/=]``), so
    every harness's shell tool passes the command unchanged."""
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as packed, tarfile.open(fileobj=packed, mode="w") as tar:
        for rel, data, executable in _packed(solution_dir):
            info = tarfile.TarInfo(rel)
            info.size, info.mode = len(data), 0o755 if executable else 0o644
            tar.addfile(_plain(info), io.BytesIO(data))
    if buffer.tell() > MAX_PACKED_BYTES:
        raise ValueError(f"{solution_dir} packs to over {MAX_PACKED_BYTES // 2**20} MiB")
    encoded = base64.b64encode(buffer.getvalue()).decode()
    target = posixpath.join("/solution", script)
    exported = "".join(f"{k}={shlex.quote(v)} " for k, v in (env or {}).items())
    return (f"mkdir -p /solution && printf %s {encoded} | base64 -d | tar -xzf - -C /solution && "
            f"chmod +x {target} && DEBIAN_FRONTEND=noninteractive {exported}{target}")


@dataclass(frozen=True)
class HarborTask:
    """One Harbor task directory, read."""

    path: Path
    config: HarborTaskConfig
    instruction: str
    #: the reader of the task's files (its budget is the task's); load_task passes the one it read task.toml with
    files: TaskFiles | None = field(default=None, compare=False, repr=False)

    @cached_property
    def reader(self) -> TaskFiles:
        """Every read of this task's files goes through it (links stay inside, no FIFOs, bounded)."""
        return self.files or TaskFiles(self.path)

    @property
    def task_id(self) -> str:
        return self.path.name

    def _dockerfile_text(self) -> str | None:
        """environment/Dockerfile's text, or None when the task has none."""
        if self.reader.kind("environment/Dockerfile") != "file":
            return None
        return self.reader.read_text("environment/Dockerfile")

    @property
    def environment_dir(self) -> Path:
        return self.path / "environment"

    @property
    def dockerfile(self) -> Path:
        return self.environment_dir / "Dockerfile"

    def dockerfile_workdir(self) -> str | None:
        """The last WORKDIR of the Dockerfile (where the agent works), or None."""
        text = self._dockerfile_text()
        if text is None:
            return None
        workdir = "/"
        seen = False
        for ins in parse_dockerfile(text):
            if ins.keyword == "WORKDIR":
                workdir = posixpath.normpath(posixpath.join(workdir, ins.args.strip().strip('"')))
                seen = True
        return workdir if seen else None

    def workdir(self, default: str) -> str:
        """task.toml's ``[environment] workdir``, else the Dockerfile's WORKDIR, else ``default``."""
        return self.config.environment.workdir or self.dockerfile_workdir() or default

    def session_dockerfile(self) -> str:
        """The task's Dockerfile plus the directories Harbor mounts (``/logs/verifier``, ``/logs/agent``,
        ``/tests``, ``/solution``), made as root and writable by the task's user: the session container has no
        capabilities, so not even its root could create them in a read-only-moded ``/`` later."""
        text = self._dockerfile_text()
        if text is None:
            raise ConfigError(f"{self.path}: no environment/Dockerfile")
        users = [ins.args.strip() for ins in parse_dockerfile(text) if ins.keyword == "USER"]
        dirs = " ".join(sorted({*_HARBOR_DIRS}))
        tail = f"\nUSER root\nRUN mkdir -p {dirs} && chmod 0777 {dirs}\n"
        if users:
            tail += f"USER {users[-1]}\n"
        return text.rstrip("\n") + "\n" + tail

    def image_tag(self) -> str:
        """A tag keyed by the environment directory's content (a changed Dockerfile, file or link builds a new one).
        The directory is walked as task files: no link is followed, a FIFO or device or a link out is refused,
        before podman is given it as the build context."""
        digest = hashlib.sha256(self.session_dockerfile().encode())
        context = self.reader.under("environment", "the environment directory")
        for entry in sorted(context.walk(), key=lambda e: PurePosixPath(e.rel).parts):
            if entry.link is not None:
                digest.update(entry.rel.encode() + b"\0->" + entry.link.encode())
            else:
                digest.update(entry.rel.encode() + b"\0" + context.read_entry(entry))
        name = "".join(c if c.isalnum() or c in "-_." else "-" for c in self.task_id.lower()).strip("-.") or "task"
        return f"localhost/polar-harbor/{name}:{digest.hexdigest()[:12]}"

    def runtime(self, base: RuntimeSpec) -> RuntimeSpec:
        """The session's runtime on ``base.backend``: local replays the Dockerfile, an image backend runs it."""
        env_cfg = self.config.environment
        update: dict[str, Any] = {
            "cpus": base.cpus if base.cpus is not None else env_cfg.cpus,
            "memory_mb": base.memory_mb if base.memory_mb is not None else env_cfg.memory_mb,
            "env": {**env_cfg.env, **base.env},
        }
        if base.backend == "local":
            text = self._dockerfile_text()
            if env_cfg.docker_image and text is None:
                raise ConfigError(f"{self.path}: the environment is the image {env_cfg.docker_image}; it needs "
                                  "runtime=docker or runtime=apptainer")
            context = (self.reader.under("environment", "the build context")
                       if self.reader.kind("environment") == "dir" else self.environment_dir)
            try:
                local = local_environment(text or "", context, default_workdir=self.workdir(base.workdir))
            except UnsupportedDockerfile as exc:
                raise ConfigError(f"{self.dockerfile} cannot be reproduced in the local sandbox; it needs "
                                  f"runtime=docker or runtime=apptainer:\n{exc}") from None
            for warning in local.warnings:
                log.warning("%s: %s", self.task_id, warning)
            workdir = self.config.environment.workdir or local.workdir
            update.update(workdir=workdir, env={**local.env, **update["env"]}, prepare=[*base.prepare, *local.prepare],
                          options={**base.options, "links": dict(HARBOR_LINKS)})
        elif base.backend == "apptainer":
            if not env_cfg.docker_image:
                raise ConfigError(f"{self.path}: runtime=apptainer runs a task's prebuilt image ([environment] "
                                  "docker_image); a task with only a Dockerfile runs on runtime=docker (built there)")
            image = env_cfg.docker_image if "://" in env_cfg.docker_image else f"docker://{env_cfg.docker_image}"
            update.update(image=image, workdir=self.workdir(base.workdir))
        else:
            built = env_cfg.docker_image or (self.image_tag() if self._dockerfile_text() is not None else None)
            if built is None:
                raise ConfigError(f"{self.path}: no environment/Dockerfile and no [environment] docker_image")
            update.update(image=built, workdir=self.workdir(base.workdir))
        return base.model_copy(update=update)

    def evaluator(self, *, refresh_runtime: bool = False, overrides: dict[str, Any] | None = None) -> EvaluatorSpec:
        """The ``harbor`` evaluator with this task's tests, verifier timeout and environment."""
        config: dict[str, Any] = {"tests": pack_files(self.reader.under("tests", "the tests directory")),
                                  "timeout": self.config.verifier.timeout_sec, "env": dict(self.config.verifier.env)}
        config.update(overrides or {})
        return EvaluatorSpec(strategy="harbor", refresh_runtime=refresh_runtime, config=config)

    def oracle_script(self, solution: Solution = "reference") -> OracleScript:
        """The reference solution as the oracle's one command (``none``: no command, the task as left)."""
        if solution == "none":
            return OracleScript(commands=[], final_answer="I did not change anything.")
        solution_dir = self.reader.under("solution", "the solution directory")
        return OracleScript(commands=[solution_command(solution_dir, env=self.config.solution.env)],
                            final_answer=_REFERENCE_ANSWER)

    def variant_names(self) -> list[str]:
        """The names of the task's alternative solutions, its ``solution-<name>/`` directories (sorted); a name
        that is not a short identifier, or such an entry that is not a directory holding ``solve.sh``, is a
        ConfigError naming it (the task is refused)."""
        return solution_variants(self.reader)

    def variant_scripts(self) -> list[OracleScript]:
        """Each ``solution-<name>/`` as an oracle script named ``<name>`` (the same final answer as the reference,
        so a variant differs only in what it runs), read as task files like ``solution/``."""
        return [OracleScript(commands=[solution_command(self.reader.under(f"{VARIANT_PREFIX}{name}",
                                                                          f"the {VARIANT_PREFIX}{name} directory"),
                                                        env=self.config.solution.env)],
                             final_answer=_REFERENCE_ANSWER, name=name)
                for name in self.variant_names()]

    def to_request(self, *, harness: str, model_name: str, runtime: RuntimeSpec, evaluator: EvaluatorSpec,
                   builder: Any, num_samples: int, timeout_seconds: float,
                   solution: Solution = "reference") -> TaskRequest:
        """The task's request; with ``solution=reference`` its ``solution-<name>/`` directories travel as
        ``metadata.oracle_variants`` (sample i plays the reference or a variant, round robin)."""
        variants = self.variant_scripts() if solution == "reference" else []
        meta = TaskMetadata(oracle=self.oracle_script(solution).model_dump(), harbor_task=str(self.path),
                            harbor_metadata=self.config.metadata,
                            **({"oracle_variants": variants} if variants else {}))
        timeout = timeout_seconds
        if self.config.agent.timeout_sec is not None:  # the agent's time plus the verifier's, as Harbor allows
            timeout = min(timeout_seconds, self.config.agent.timeout_sec + self.config.verifier.timeout_sec)
        return TaskRequest.model_validate({
            "task_id": self.task_id, "instruction": self.instruction, "num_samples": num_samples,
            "timeout_seconds": timeout, "runtime": self.runtime(runtime).model_dump(),
            "agent": {"harness": harness, "model_name": model_name}, "builder": builder.model_dump(),
            "evaluator": evaluator.model_dump(), "metadata": meta.model_dump()})


def solution_variants(files: TaskFiles) -> list[str]:
    """The names ``<name>`` of the ``solution-<name>/`` entries of a task directory (sorted), each checked: a short
    identifier other than ``reference`` (:data:`polar_gym.schema.ORACLE_NAME_PATTERN`), a directory inside the task
    (a link out is refused by the reader) holding ``solve.sh``. ConfigError naming the entry otherwise."""
    with os.scandir(files.root) as entries:
        found = sorted(e.name for e in itertools.islice(entries, MAX_TASK_ENTRIES)
                       if e.name.startswith(VARIANT_PREFIX))
    names = []
    for entry in found:
        name = entry.removeprefix(VARIANT_PREFIX)
        if not re.fullmatch(ORACLE_NAME_PATTERN, name) or name == "reference":
            raise ConfigError(f"{files.task}: {entry!r}: an alternative solution directory is solution-NAME with "
                              "NAME of letters, digits, - and _ (at most 64, not 'reference')")
        if files.kind(entry) != "dir":
            raise ConfigError(f"{files.task}: {entry}: an alternative solution must be a directory (like solution/)")
        if files.kind(f"{entry}/solve.sh") != "file":
            raise ConfigError(f"{files.task}: missing {entry}/solve.sh")
        names.append(name)
    return names


def _problem(path: Path, message: str) -> ConfigError:
    return ConfigError(f"{path}: {message}")


def _host_env_problems(path: Path, config: HarborTaskConfig) -> list[str]:
    """One line per name a section's ``env`` sets that the host's loader or container engine would read
    (``[verifier] env``, ``[environment] env``, ``[solution] env``, ``[agent] env``, any other section's)."""
    problems = []
    for section, value in config.model_dump().items():
        env = value.get("env") if isinstance(value, dict) and section != "metadata" else None
        if not isinstance(env, dict):
            continue
        problems += [f"{path}: [{section}] env sets {name!r}: refused, a dynamic loader or container engine reads "
                     "it as an instruction (a task's env reaches only the sandboxed command; a task that needs it "
                     "sets it in its own scripts)" for name in host_read_env_names({str(k): "" for k in env})]
    return problems


def load_task(path: Path) -> HarborTask:
    """Read one task directory as untrusted files (:mod:`polar_gym.tasks.files`); ConfigError naming the task and
    what is missing, invalid or refused."""
    path = path.resolve()
    files = TaskFiles(path)
    if files.kind("task.toml") != "file":
        raise _problem(path, "not a Harbor task (no task.toml)")
    try:
        config = HarborTaskConfig.from_toml(files.read_text("task.toml"))
    except (tomllib.TOMLDecodeError, ValidationError) as exc:
        raise _problem(path, f"task.toml does not parse: {exc}") from None
    if config.steps:
        raise _problem(path, "multi-step tasks ([[steps]]) are not supported")
    if config.environment.os.lower() != "linux":
        raise _problem(path, f"[environment] os = {config.environment.os!r}: only linux tasks run here")
    if env_problems := _host_env_problems(path, config):
        raise ConfigError("\n".join(env_problems))
    compose = [n for n in ("docker-compose.yaml", "docker-compose.yml", "compose.yaml")
               if files.kind(f"environment/{n}") == "file"]
    if compose:
        raise _problem(path, f"environment/{compose[0]}: multi-container environments are not supported")
    missing = [name for name in ("instruction.md", "tests/test.sh", "solution/solve.sh")
               if files.kind(name) != "file"]
    if missing:
        raise _problem(path, f"missing {', '.join(missing)}")
    solution_variants(files)  # a bad solution-NAME/ refuses the task when it loads
    return HarborTask(path=path, config=config, instruction=files.read_text("instruction.md"), files=files)


def scan_tasks(path: str | Path, ids: list[str] | None = None) -> tuple[list[HarborTask], list[RefusedTask]]:
    """A task directory, or every task directory directly under ``path`` (sorted by name; ``ids`` picks some): the
    tasks that load and the ones refused, each named by its directory with every problem found. A ConfigError only
    for the set itself (no directory, no task in it, an unknown id)."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory")
    if os.path.lexists(root / "task.toml"):
        dirs = [root]
    else:
        dirs = [d for d in sorted(root.iterdir()) if os.path.lexists(d / "task.toml")]
        if not dirs:
            raise ConfigError(f"{root} holds no Harbor task (a directory with a task.toml)")
        if ids is not None:  # a broken task that was not asked for does not stop the ones that were
            names = {Path(os.path.realpath(d)).name for d in dirs}
            dirs = [d for d in dirs if Path(os.path.realpath(d)).name in ids] if set(ids) <= names else dirs
    tasks: list[HarborTask] = []
    refused: list[RefusedTask] = []
    for directory in dirs:  # every task is read: one bad task does not hide another
        try:
            tasks.append(load_task(directory))
        except ConfigError as exc:
            refused.append(RefusedTask(Path(os.path.realpath(directory)).name, str(exc)))
    if ids is not None:
        known = {t.task_id: t for t in tasks}
        unknown = [i for i in ids if i not in known and i not in {r.task_id for r in refused}]
        if unknown:
            raise ConfigError(f"unknown task(s) {unknown}; known: {', '.join([*known, *(r.task_id for r in refused)])}")
        tasks = [known[i] for i in ids if i in known]
        refused = [r for r in refused if r.task_id in ids]
    return tasks, refused


def refusal(path: str | Path, refused: list[RefusedTask], of: int) -> ConfigError:
    """The one error naming every refused task of a set of ``of`` tasks under ``path``."""
    return ConfigError("", problems=[("", r.problem) for r in refused],
                       title=f"{len(refused)} of the {of} Harbor tasks under {Path(path).expanduser()} cannot be used")


def find_tasks(path: str | Path, ids: list[str] | None = None) -> list[HarborTask]:
    """:func:`scan_tasks`'s tasks; a ConfigError naming every refused one if any is."""
    tasks, refused = scan_tasks(path, ids)
    if refused:
        raise refusal(path, refused, len(tasks) + len(refused))
    return tasks
