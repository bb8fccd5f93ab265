"""A private PostgreSQL server for one run or one test session, from Debian's ``postgresql-15`` package: its own data
folder, no TCP port, reachable only through a Unix socket in a folder of mode 0700 (so no password exists to leak:
only the owner, and root, can connect). Several server workers on one node share it.

    python -m polar_gym.server.postgres_local start DIR    prints the URL to pass as --db
    python -m polar_gym.server.postgres_local stop DIR

As root, the server runs as the ``postgres`` system user (PostgreSQL refuses to run as root), which owns DIR, with
one capability, CAP_DAC_READ_SEARCH: DIR may then sit in a run's owner-only folders (its state_dir), which that user
could not otherwise enter, and nothing else of those folders changes."""

from __future__ import annotations

import argparse
import glob
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["PrivatePostgres", "postgres_bin"]

#: the system user a root-started server runs as (Debian's package creates it)
SYSTEM_USER = "postgres"


def postgres_bin() -> Path | None:
    """The folder of Debian's PostgreSQL server programs (initdb, pg_ctl), newest version first; None if absent."""
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name),
                         reverse=True):
        if (Path(folder) / "initdb").exists():
            return Path(folder)
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


class PrivatePostgres:
    """``start()`` creates the cluster once and starts it (idempotent); ``stop()`` stops it, keeping the data."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.data, self.socket_dir, self.log = self.root / "data", self.root / "run", self.root / "postgres.log"
        found = postgres_bin()
        if found is None:
            raise RuntimeError("PostgreSQL's server programs are missing: apt-get install postgresql-15 "
                               "(bash scripts/setup.sh does it as root)")
        self.bin = found
        self.as_user = SYSTEM_USER if os.geteuid() == 0 else None

    @property
    def url(self) -> str:
        """The connection URL: the socket folder as host, the owner's role, the default database."""
        user = self.as_user or pwd.getpwuid(os.geteuid()).pw_name
        return f"postgresql://{user}@/postgres?host={self.socket_dir}"

    def _command(self, *argv: str) -> list[str]:
        if self.as_user is None:
            return list(argv)
        return ["setpriv", f"--reuid={self.as_user}", f"--regid={self.as_user}", "--init-groups",
                "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", "--", *argv]

    def _run(self, *argv: str, timeout: float = 120) -> None:
        done = subprocess.run(self._command(*argv), capture_output=True, text=True, timeout=timeout, check=False,
                              cwd="/")  # the postgres user may not enter the caller's folder
        if done.returncode != 0:
            log_tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{Path(argv[0]).name} failed ({done.returncode}): {done.stderr.strip()[-2000:]}"
                               + (f"\n{log_tail}" if log_tail else ""))

    def running(self) -> bool:
        done = subprocess.run(self._command(str(self.bin / "pg_ctl"), "-D", str(self.data), "status"),
                              capture_output=True, text=True, check=False, cwd="/")
        return done.returncode == 0

    def start(self, timeout: float = 120) -> str:
        """Create (first time) and start the server; returns its URL once it accepts connections."""
        self.root.mkdir(parents=True, exist_ok=True)
        for folder in (self.root, self.socket_dir):
            folder.mkdir(exist_ok=True)
            folder.chmod(0o700)
            if self.as_user:
                entry = pwd.getpwnam(self.as_user)
                os.chown(folder, entry.pw_uid, entry.pw_gid)
        if not (self.data / "PG_VERSION").exists():
            self._run(str(self.bin / "initdb"), "-D", str(self.data), "--auth=trust", "--encoding=UTF8",
                      "--no-instructions")
        if not self.running():
            options = (f"-c listen_addresses='' -c unix_socket_directories='{self.socket_dir}' "
                       "-c unix_socket_permissions=0700 -c max_connections=200")
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options,
                      "-w", "-t", str(int(timeout)), "start", timeout=timeout + 10)
        return self.url

    def stop(self) -> None:
        if self.data.exists() and self.running():
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - process glue
    p = argparse.ArgumentParser(prog="python -m polar_gym.server.postgres_local", description=__doc__.split("\n")[0])
    p.add_argument("action", choices=("start", "stop", "url"))
    p.add_argument("dir", type=Path)
    args = p.parse_args(argv)
    server = PrivatePostgres(args.dir)
    if args.action == "start":
        print(server.start())
    elif args.action == "stop":
        server.stop()
    else:
        print(server.url)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
