"""A Dockerfile read as data, and the subset the local sandbox can reproduce without building an image.

Why a subset: Harbor tasks describe their environment as a Dockerfile, but most small tasks only set a WORKDIR,
COPY files from the build context and RUN a command or two. The local (bubblewrap) sandbox runs on the host's own
system directories, so such a Dockerfile is replayed as prepare actions (uploads and execs) over the host system
and the base image is ignored, with a warning. Anything else (installing packages, other users, copies from other
images or outside the writable workdir) needs a real image: runtime=docker or runtime=apptainer.

The build context is read as task files (:mod:`polar_gym.tasks.files`): a COPY source that leaves it (``..``, a link
out), a FIFO, device or socket in it, or a file over the caps is refused (:class:`TaskFileError`) whatever the
runtime, since Docker would not copy it either; an ``ENV`` a host's loader or container engine reads is refused too.
"""

from __future__ import annotations

import base64
import json
import posixpath
import re
import shlex
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from polar_gym.schema import PrepareAction, host_read_env_names
from polar_gym.tasks.files import TaskFiles

__all__ = [
    "INSTALLERS",
    "Instruction",
    "LocalEnvironment",
    "UnsupportedDockerfile",
    "local_environment",
    "parse_dockerfile",
]

#: programs that install software: a RUN naming one needs an image (the sandbox has no network, no root)
INSTALLERS = frozenset({"apt-get", "apt", "aptitude", "dpkg", "apk", "yum", "dnf", "microdnf", "zypper", "pip",
                        "pip3", "uv", "uvx", "npm", "npx", "pnpm", "yarn", "conda", "mamba", "curl", "wget",
                        "gem", "cargo", "go", "sudo", "su", "useradd", "adduser", "chown"})
#: shell words that are not programs (builtins, keywords)
_SHELL_WORDS = frozenset({"cd", "export", "set", "unset", "true", "false", ":", ".", "source", "exit", "if",
                          "then", "else", "elif", "fi", "for", "do", "done", "while", "until", "case", "esac",
                          "echo", "printf", "test", "[", "[[", "!", "{", "}", "umask", "shift", "read", "local"})
#: instructions that change nothing the agent or verifier sees (Harbor keeps the container alive on its own)
_IGNORED = frozenset({"LABEL", "EXPOSE", "CMD", "ENTRYPOINT", "HEALTHCHECK", "STOPSIGNAL", "MAINTAINER", "ARG"})
#: the context's total size the sandbox copies (a bigger environment belongs in an image)
MAX_CONTEXT_BYTES = 32 * 1024 * 1024


class UnsupportedDockerfile(ValueError):
    """The Dockerfile needs a real image; the message lists every reason, one per line."""


@dataclass(frozen=True)
class Instruction:
    """One instruction: its keyword (upper case), its flags (``--from=...``) and its arguments text."""

    keyword: str
    args: str
    flags: tuple[str, ...] = ()
    line: int = 0


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Lines with backslash continuations joined and comments dropped, each with its first line number."""
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if not pending:
            start = number
        if raw.rstrip().endswith("\\"):
            pending.append(raw.rstrip()[:-1])
            continue
        pending.append(raw)
        out.append((start, " ".join(p.strip() for p in pending if p.strip())))
        pending = []
    if pending:
        out.append((start, " ".join(p.strip() for p in pending if p.strip())))
    return out


def parse_dockerfile(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile, in order (continuations joined, comments dropped, flags split off)."""
    instructions = []
    for number, line in _logical_lines(text):
        keyword, _, rest = line.partition(" ")
        rest = rest.strip()
        flags: list[str] = []
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            flags.append(flag)
            rest = rest.strip()
        instructions.append(Instruction(keyword.upper(), rest, tuple(flags), number))
    return instructions


def _exec_form(args: str) -> list[str] | None:
    """The JSON array form of RUN / COPY (``["a", "b"]``), or None for the shell form."""
    if not args.startswith("["):
        return None
    try:
        value = json.loads(args)
    except ValueError:
        return None
    return [str(v) for v in value] if isinstance(value, list) else None


def _programs(command: str) -> list[str]:
    """The programs a shell command runs: the first word of each simple command (assignments skipped)."""
    try:
        lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|()")
        lexer.whitespace_split = True
        tokens = list(lexer)
    except ValueError:
        return [command.split()[0]] if command.split() else []
    programs, expect = [], True
    for token in tokens:
        if token and set(token) <= set(";&|()"):
            expect = True
            continue
        if expect:
            if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", token):
                continue
            programs.append(token)
            expect = token in {"if", "then", "else", "elif", "do", "while", "until", "!", "{"}
    return programs


def _env_pairs(args: str) -> dict[str, str]:
    """``ENV a=1 b="x y"`` or the legacy ``ENV a 1``."""
    words = shlex.split(args)
    if words and "=" not in words[0]:
        return {words[0]: args.split(None, 1)[1] if len(words) > 1 else ""}
    return dict(w.split("=", 1) for w in words if "=" in w)


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


@dataclass
class LocalEnvironment:
    """What the local sandbox replays: the agent's workdir, the environment variables and the prepare actions."""

    workdir: str
    env: dict[str, str] = field(default_factory=dict)
    prepare: list[PrepareAction] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _file_action(data: bytes, dst: str, executable: bool) -> list[PrepareAction]:
    """Upload one file: text as content, anything else decoded from base64 in the sandbox (coreutils)."""
    try:
        actions = [PrepareAction(type="upload_file", dst=dst, content=data.decode("utf-8"))]
    except UnicodeDecodeError:
        encoded = base64.b64encode(data).decode()
        parent = shlex.quote(posixpath.dirname(dst) or "/")
        actions = [PrepareAction(type="exec", command=f"mkdir -p {parent} && printf %s {encoded} | base64 -d > "
                                 f"{shlex.quote(dst)}", timeout_seconds=60)]
    if executable:
        actions.append(PrepareAction(type="exec", command=f"chmod +x {shlex.quote(dst)}", timeout_seconds=60))
    return actions


def _copy(context: TaskFiles, sources: list[str], dst: str, workdir: str, problems: list[str],
          line: int) -> list[PrepareAction]:
    """COPY ``sources`` (relative to the build context) to ``dst`` with Docker's rules for trailing slashes; the
    sources are read as task files (a source leaving the context or a special file raises TaskFileError)."""
    target = posixpath.normpath(posixpath.join(workdir, dst))
    into_dir = dst.endswith("/") or len(sources) > 1
    actions: list[PrepareAction] = []
    for source in sources:
        if any(c in source for c in "*?["):
            problems.append(f"line {line}: COPY with a wildcard ({source})")
            continue
        rel = source.lstrip("/") or "."  # Docker reads /x as the context's x; ".." is resolved by kind()
        kind = context.kind(rel)  # refuses a source out of the context (.., a link out), a FIFO, device, socket
        if kind == "missing":
            problems.append(f"line {line}: COPY {source}: no such file in the build context")
        elif kind == "dir":
            entries = [e for e in context.walk(rel) if e.link is None]  # links inside are not followed
            for entry in entries:
                actions += _file_action(context.read_entry(entry, rel), posixpath.join(target, entry.rel),
                                        entry.executable)
            if not entries:
                actions.append(PrepareAction(type="exec", command=f"mkdir -p {shlex.quote(target)}",
                                             timeout_seconds=60))
        else:
            path = context.locate(rel)
            dest = posixpath.join(target, posixpath.basename(rel)) if into_dir else target
            actions += _file_action(context.read_bytes(rel), dest, bool(path.stat().st_mode & 0o111))
    return actions


def _context_size(context: TaskFiles) -> int:
    return sum(e.size for e in context.walk())


def local_environment(dockerfile: str, context: Path | TaskFiles, *, default_workdir: str = "/app",
                      which: Callable[[str], str | None] = shutil.which) -> LocalEnvironment:
    """Replay ``dockerfile`` (built from ``context``) as prepare actions for the local sandbox.

    Copies and commands must stay under the final WORKDIR (the sandbox's one writable directory besides /tmp);
    a RUN may use only programs the host has (``which``) and no installer. Raises :class:`UnsupportedDockerfile`
    listing everything that needs an image.
    """
    instructions = parse_dockerfile(dockerfile)
    if isinstance(context, Path):
        context = TaskFiles(context, scope="the build context")
    problems: list[str] = []
    warnings: list[str] = []
    workdir = "/"
    workdirs: list[str] = []
    for ins in instructions:
        if ins.keyword == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, ins.args.strip().strip('"')))
            workdirs.append(workdir)
    final = workdirs[-1] if workdirs else default_workdir
    if final == "/":
        problems.append("WORKDIR / cannot be the sandbox's workdir")
    if _context_size(context) > MAX_CONTEXT_BYTES:
        problems.append(f"the build context is over {MAX_CONTEXT_BYTES // 2**20} MiB")
    env: dict[str, str] = {}
    prepare: list[PrepareAction] = []
    workdir = final if not workdirs else "/"
    for ins in instructions:
        where = f"line {ins.line}"
        if ins.keyword == "FROM":
            warnings.append(f"the base image ({ins.args}) is ignored on runtime=local: the sandbox runs on the "
                            "host's system (use runtime=docker for the image itself)")
        elif ins.keyword in _IGNORED:
            continue
        elif ins.keyword == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, ins.args.strip().strip('"')))
            if _within(final, workdir) and workdir != final:
                continue  # a parent of the final workdir: nothing to create outside it
            if not _within(workdir, final):
                problems.append(f"{where}: WORKDIR {workdir} lies outside the final WORKDIR {final}")
        elif ins.keyword == "ENV":
            pairs = _env_pairs(ins.args)
            for name in host_read_env_names(pairs):
                problems.append(f"{where}: ENV {name}: a dynamic loader or container engine reads it, and the "
                                "local sandbox's environment passes through host programs")
            env.update(pairs)
        elif ins.keyword == "COPY":
            if any(f.startswith("--from") for f in ins.flags):
                problems.append(f"{where}: COPY {' '.join(ins.flags)} copies from another image")
                continue
            words = _exec_form(ins.args) or shlex.split(ins.args)
            if len(words) < 2:
                problems.append(f"{where}: COPY needs a source and a destination")
                continue
            dst = posixpath.normpath(posixpath.join(workdir, words[-1]))
            if not (_within(dst, final) or _within(dst, "/tmp")):
                problems.append(f"{where}: COPY to {dst}, outside the WORKDIR {final}")
                continue
            prepare += _copy(context, words[:-1], words[-1], workdir, problems, ins.line)
        elif ins.keyword == "RUN":
            if ins.flags:
                problems.append(f"{where}: RUN {' '.join(ins.flags)} (mounts or network flags)")
                continue
            argv = _exec_form(ins.args)
            command = shlex.join(argv) if argv is not None else ins.args
            programs = [argv[0]] if argv else _programs(command)
            installers = sorted({p for p in programs if posixpath.basename(p) in INSTALLERS})
            missing = sorted({p for p in programs if p not in _SHELL_WORDS and posixpath.basename(p) not in
                              INSTALLERS and which(p) is None})
            if installers:
                problems.append(f"{where}: RUN installs software ({', '.join(installers)})")
            if missing:
                problems.append(f"{where}: RUN uses {', '.join(missing)}, which this host does not have")
            if not (_within(workdir, final) or _within(workdir, "/tmp")):
                problems.append(f"{where}: RUN in {workdir}, outside the WORKDIR {final}")
            if not installers and not missing:
                prepare.append(PrepareAction(type="exec", command=f"mkdir -p {shlex.quote(workdir)} && cd "
                                             f"{shlex.quote(workdir)} && {command}", timeout_seconds=600))
        else:
            problems.append(f"{where}: {ins.keyword} is not reproduced in the local sandbox")
    if problems:
        raise UnsupportedDockerfile("\n".join(problems))
    if env:  # later RUNs see earlier ENVs in Docker; replaying them all with the final values is close enough
        exported = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        prepare = [a.model_copy(update={"command": f"export {exported}; {a.command}"})
                   if a.type == "exec" and isinstance(a.command, str) else a for a in prepare]
    return LocalEnvironment(workdir=final, env=env, prepare=prepare, warnings=warnings)
