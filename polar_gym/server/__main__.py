"""The rollout server as a process.

    python -m polar_gym.server --port N --db PATH --admin-token T [--host H] [--heartbeat S] [--dead-after S]

The admin token may come from ``POLAR_ADMIN_TOKEN``; the SQLite db keeps every task, so restarting with the same
``--db`` resumes dispatching the unfinished sessions.
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
    p.add_argument("--db", type=Path, default=Path("polar_gym-server.sqlite"))
    p.add_argument("--admin-token", default=os.environ.get("POLAR_ADMIN_TOKEN"))
    p.add_argument("--heartbeat", type=float, default=2.0, help="seconds between gateway health probes")
    p.add_argument("--dead-after", type=float, default=10.0, help="seconds without heartbeat before re-dispatch")
    p.add_argument("--max-attempts", type=int, default=3, help="dispatches per session before it fails")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    if not args.admin_token:
        p.error("--admin-token (or POLAR_ADMIN_TOKEN) is required")
    if args.max_attempts < 1 or args.heartbeat <= 0 or args.dead_after <= 0:
        p.error("--max-attempts, --heartbeat and --dead-after must be positive")
    return args


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - process glue
    import uvicorn

    from polar_gym.server.app import create_server_app
    from polar_gym.server.core import RolloutServer
    from polar_gym.server.store import Store

    args = parse_args(argv)
    store = Store(args.db)
    server = RolloutServer(store, heartbeat_interval=args.heartbeat, dead_after=args.dead_after,
                           max_attempts=args.max_attempts)
    try:
        uvicorn.run(create_server_app(server, args.admin_token), host=args.host, port=args.port,
                    log_level=args.log_level)
    finally:
        store.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
