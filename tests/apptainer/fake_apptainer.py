"""A stand-in for the ``apptainer``/``singularity`` CLI, installed on PATH by the tests (see ``conftest.py``).

It logs every argv (JSON lines in ``$FAKE_APPTAINER_STATE/argv.log``) and simulates the behaviour the runtime relies
on, without any isolation: ``instance start`` spawns a detached ``sleep`` as the instance and records it; ``instance
list --json`` reports live instances; ``exec [--env-file F] instance://NAME CMD`` runs CMD on the host with the
shell assignments of F (and ``APPTAINERENV_X`` as ``X``) under a clean environment, with absolute paths rewritten
(bind destinations to their sources, other non-system paths under a per-instance fake root), and exits 255 if the
instance is gone or dies meanwhile; ``instance stop`` kills the instance and its execs;
``overlay create`` makes a sparse file.

Switches (environment): FAKE_APPTAINER_BROKEN (``--version`` fails), FAKE_START_FAIL (``instance start`` fails with
a FATAL line), FAKE_START_DIES (the instance exits right after starting), FAKE_STOP_FAIL (a graceful stop fails;
``--force`` works).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

STATE = Path(os.environ["FAKE_APPTAINER_STATE"])
SYSTEM = ("/bin", "/usr", "/proc", "/dev", "/etc", "/lib", "/lib64", "/sbin", "/sys")
VALUED = {"--network", "--overlay", "--bind", "-B", "--hostname", "--cpus", "--memory", "--pids-limit", "--pwd",
          "--env", "--env-file", "--size", "-t", "--timeout"}


def fatal(message: str) -> None:
    print(f"FATAL:   {message}", file=sys.stderr)
    sys.exit(255)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as dead
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def parse(args: list[str]) -> tuple[list[tuple[str, str | None]], list[str]]:
    opts: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args) and args[i].startswith("-"):
        if "=" in args[i] and args[i].split("=", 1)[0] in VALUED:
            key, value = args[i].split("=", 1)
            opts.append((key, value))
            i += 1
        elif args[i] in VALUED:
            opts.append((args[i], args[i + 1]))
            i += 2
        else:
            opts.append((args[i], None))
            i += 1
    return opts, args[i:]


def load(name: str) -> dict | None:
    path = STATE / f"{name}.json"
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    return doc if alive(doc["pid"]) else None


def mapper(doc: dict):
    binds = sorted(doc["binds"].items(), key=lambda kv: -len(kv[0]))
    root = doc["root"]

    def map_path(arg: str) -> str:
        if not arg.startswith("/"):
            return arg
        for dst, src in binds:
            if arg == dst or arg.startswith(dst + "/"):
                return src + arg[len(dst):]
        if arg.startswith(SYSTEM):
            return arg
        return root + (arg if arg != "/" else "")
    return map_path


def kill_my_group() -> None:
    me, group = os.getpid(), os.getpgid(0)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        pid = int(stat.parent.name)
        if int(fields[2]) == group and pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def instance_start(args: list[str]) -> None:
    opts, rest = parse(args)
    image, name = rest[0], rest[1]
    if os.environ.get("FAKE_START_FAIL"):
        fatal(f"container creation failed: fake failure starting {image}")
    if (STATE / f"{name}.json").exists() and load(name):
        fatal(f"instance {name} already exists")
    binds = {}
    for key, value in opts:
        if key in ("--bind", "-B") and value:
            parts = value.split(":")
            binds[parts[1] if len(parts) > 1 else parts[0]] = parts[0]
    root = STATE / f"{name}.root"
    root.mkdir(parents=True, exist_ok=True)
    seconds = "0" if os.environ.get("FAKE_START_DIES") else "3600"
    daemon = subprocess.Popen(["sleep", seconds], start_new_session=True, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    doc = {"pid": daemon.pid, "image": image, "binds": binds, "root": str(root), "opts": opts}
    (STATE / f"{name}.json").write_text(json.dumps(doc))
    print("INFO:    instance started successfully", file=sys.stderr)
    if seconds == "0":
        daemon.wait()


def instance_list(args: list[str]) -> None:
    _, rest = parse(args)
    entries = []
    for path in sorted(STATE.glob("*.json")):
        name = path.stem
        doc = load(name)
        if doc is not None and (not rest or rest[0] == name):
            entries.append({"instance": name, "pid": doc["pid"], "img": doc["image"], "ip": ""})
    print(json.dumps({"instances": entries}, indent=1))


def kill_instance(name: str, doc: dict) -> None:
    execs = STATE / f"{name}.execs"
    tokens = execs.read_text().split() if execs.exists() else []
    # like the end of a PID namespace: the instance, every exec's command and every exec's process group
    for token in [str(doc["pid"]), *tokens]:
        try:
            if token.startswith("-"):
                os.killpg(int(token[1:]), signal.SIGKILL)
            else:
                os.kill(int(token), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    (STATE / f"{name}.json").unlink()
    execs.unlink(missing_ok=True)


def instance_stop(args: list[str]) -> None:
    opts, rest = parse(args)
    name = rest[0]
    doc = load(name)
    if doc is None:
        fatal(f"no instance found with name {name}")
    if os.environ.get("FAKE_STOP_FAIL") and not any(k in ("--force", "-F") for k, _ in opts):
        fatal(f"could not stop {name}: fake failure")
    kill_instance(name, doc)
    print(f"INFO:    Stopping {name} instance of {doc['image']} (PID={doc['pid']})", file=sys.stderr)


def execute(args: list[str]) -> None:
    opts, rest = parse(args)
    target, command = rest[0], rest[1:]
    if not target.startswith("instance://"):
        fatal("the fake only runs commands in instances")
    name = target[len("instance://"):]
    doc = load(name)
    if doc is None:
        fatal(f"no instance found with name {name}")
    map_path = mapper(doc)
    cwd = map_path(dict(opts).get("--pwd") or "/")
    if not os.path.isdir(cwd):
        fatal(f"--pwd {dict(opts).get('--pwd')}: no such directory")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    env.update({k[len("APPTAINERENV_"):]: v for k, v in os.environ.items() if k.startswith("APPTAINERENV_")})
    env_file = dict(opts).get("--env-file")
    if env_file:  # NAME='value' lines, as Apptainer reads them (a shell script)
        env.update(word.split("=", 1) for word in shlex.split(Path(env_file).read_text()))  # type: ignore[misc]
    child = subprocess.Popen([map_path(a) for a in command], cwd=cwd, env=env)
    with open(STATE / f"{name}.execs", "a") as f:
        f.write(f"{child.pid} -{os.getpgid(0)}\n")
    signal.signal(signal.SIGTERM, lambda *_: child.kill())
    while True:
        try:
            code = child.wait(timeout=0.05)
            break
        except subprocess.TimeoutExpired:
            if not alive(doc["pid"]):  # like the end of the PID namespace: everything the command started dies
                kill_my_group()
                child.wait()
                fatal(f"instance {name} died")
    sys.exit(code if code >= 0 else 128 - code)


def overlay_create(args: list[str]) -> None:
    opts, rest = parse(args)
    size = int(dict(opts)["--size"])
    with open(rest[0], "wb") as f:
        f.truncate(size * 1024 * 1024)


def main() -> None:
    args = sys.argv[1:]
    STATE.mkdir(parents=True, exist_ok=True)
    with open(STATE / "argv.log", "a") as f:
        f.write(json.dumps({"argv0": os.environ.get("FAKE_ARGV0", ""), "args": args, "t": time.time(),
                            "env": dict(os.environ), "cwd": os.getcwd()}) + "\n")
    while args and args[0] in ("--quiet", "-q", "--debug", "-d", "--silent", "-s"):
        args = args[1:]
    if args[:1] == ["--version"]:
        if os.environ.get("FAKE_APPTAINER_BROKEN"):
            print("error while loading shared libraries", file=sys.stderr)
            sys.exit(1)
        print("apptainer version 1.3.4-fake")
        return
    verbs = {("instance", "start"): instance_start, ("instance", "list"): instance_list,
             ("instance", "stop"): instance_stop, ("overlay", "create"): overlay_create}
    if tuple(args[:2]) in verbs:
        verbs[tuple(args[:2])](args[2:])  # type: ignore[index]
    elif args[:1] == ["exec"]:
        execute(args[1:])
    else:
        fatal(f"the fake does not know {args}")


if __name__ == "__main__":
    main()
