"""The rollout server as a process.

    python -m polar_gym.server --port N --db PATH|URL [--worker NAME] [--admin-token-file F | --admin-token T]
                               [--host H]
                               [--heartbeat S] [--dead-after S] [--max-samples N] [--max-body-mb M]
                               [--weight-server URL ...] [--result-retention keep|compact|drop]

The admin token is best given by ``POLAR_ADMIN_TOKEN`` or ``--admin-token-file`` (a command line is readable by
every user of the host); it is never logged. The SQLite db (mode 0600: it holds the gateways' admin tokens) keeps
every task, so restarting with the same ``--db`` resumes dispatching the unfinished sessions.

Several server workers: give each the same PostgreSQL database (``--db postgresql://...``; the URL is best given by
``POLAR_DB``, as it may hold a password), a ``--worker`` name of its own and a port of its own. Each watches and
dispatches to the gateways that register with it; any of them takes tasks and fleet-wide calls.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m polar_gym.server", description="polar_gym's rollout server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8700)
    p.add_argument("--db", default=os.environ.get("POLAR_DB", "polar_gym-server.sqlite"),
                   help="a SQLite file, or a postgresql:// URL several server workers share (default: POLAR_DB)")
    p.add_argument("--worker", default="main", help="this server worker's name, unique among the workers of a store")
    p.add_argument("--admin-token", default=os.environ.get("POLAR_ADMIN_TOKEN"),
                   help="prefer POLAR_ADMIN_TOKEN or --admin-token-file: other users can read a command line")
    p.add_argument("--admin-token-file", type=Path, help="a file holding the admin token")
    p.add_argument("--heartbeat", type=float, default=2.0, help="seconds between gateway health probes")
    p.add_argument("--dead-after", type=float, default=10.0, help="seconds without heartbeat before re-dispatch")
    p.add_argument("--max-attempts", type=int, default=3, help="dispatches per session before it fails")
    p.add_argument("--max-samples", type=int, default=4096, help="most sessions one task may ask for")
    p.add_argument("--max-body-mb", type=float, default=16.0, help="largest request body accepted, in MiB")
    p.add_argument("--weight-server", action="append", default=[], metavar="URL",
                   help="an inference server a weight update's `servers` may name besides the fleet's own "
                        "(repeatable; a URL without a port allows every port of its host)")
    p.add_argument("--result-retention", choices=("keep", "compact", "drop"), default="keep",
                   help="what the store keeps of a task's results once its callback was delivered: everything, all "
                        "but the trajectories, or only status, reason and reward")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    if args.admin_token_file is not None:
        try:
            args.admin_token = args.admin_token_file.read_text().strip()
        except OSError as exc:
            p.error(f"cannot read --admin-token-file: {exc.strerror}")
    if not args.admin_token:
        p.error("--admin-token-file, POLAR_ADMIN_TOKEN or --admin-token is required")
    from polar_gym.httpguard import check_upstream_url

    for url in args.weight_server:
        try:
            check_upstream_url(url)
        except ValueError as exc:
            p.error(f"--weight-server {url!r}: {exc}")
    if args.max_attempts < 1 or args.heartbeat <= 0 or args.dead_after <= 0 or args.max_samples < 1 \
            or args.max_body_mb <= 0:
        p.error("--max-attempts, --heartbeat, --dead-after, --max-samples and --max-body-mb must be positive")
    return args


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - process glue
    import uvicorn

    from polar_gym.server.app import create_server_app
    from polar_gym.server.core import RolloutServer
    from polar_gym.server.store import Store

    args = parse_args(argv)
    store = Store(args.db)
    server = RolloutServer(store, heartbeat_interval=args.heartbeat, dead_after=args.dead_after,
                           max_attempts=args.max_attempts, max_samples=args.max_samples,
                           weight_servers=args.weight_server, result_retention=args.result_retention,
                           worker=args.worker)
    try:
        uvicorn.run(create_server_app(server, args.admin_token, max_body_bytes=int(args.max_body_mb * 2**20)),
                    host=args.host, port=args.port, log_level=args.log_level)
    finally:
        store.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
