"""Gateway node: the proxy plus the staged session lifecycle, on one server.

    python -m polar_gym.gateway --engine {vllm,sglang,openai,oracle} [--upstream URL ...] --port N
        --capture-dir DIR --workdir DIR [--init-workers N --ready-buffer N --run-slots N --postrun-workers N]
        [--runtime-option KEY=JSON ...] [--expose-root DIR ...]

With ``--server-url`` the node registers with a rollout server once it listens, pushes its stage metrics as
heartbeats and registers again if the server forgot it. Only registered sessions are served. The admin token (for
POST /sessions, cancel, drain, /admin/*) comes from ``--admin-token`` or ``POLAR_ADMIN_TOKEN``; otherwise a fresh
one is written to ``--admin-token-file`` (default ``WORKDIR/admin-token``, mode 600) and only that path is printed,
so the token never lands in a job log other users can read. On SIGINT/SIGTERM the server stops and every live
session is cancelled and torn down; POST /gateway/drain?wait=true first for a graceful end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from pathlib import Path

import uvicorn

from polar_gym.gateway.api import build_gateway
from polar_gym.gateway.config import GatewayConfig
from polar_gym.gateway.registration import ServerLink
from polar_gym.proxy.__main__ import add_proxy_arguments, admin_token_from, build_service
from polar_gym.runtime.base import GatewayEndpoint

__all__ = ["config_from_args", "main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m polar_gym.gateway", description="polar_gym's gateway node")
    add_proxy_arguments(p)
    p.add_argument("--advertise-host", default=None,
                   help="the host runtimes use to reach this node (default: --host, or 127.0.0.1 for 0.0.0.0)")
    p.add_argument("--workdir", type=Path, default=Path("polar_gym-gateway"), help="per-session directories")
    p.add_argument("--init-workers", type=int, default=4)
    p.add_argument("--ready-buffer", type=int, default=4)
    p.add_argument("--run-slots", type=int, default=8)
    p.add_argument("--postrun-workers", type=int, default=4)
    p.add_argument("--prewarm-workers", type=int, default=2)
    p.add_argument("--postrun-grace", type=float, default=300.0, help="seconds POSTRUN may run past the deadline")
    p.add_argument("--server-url", default=os.environ.get("POLAR_SERVER_URL"),
                   help="rollout server to register with and heartbeat to (default: $POLAR_SERVER_URL, else none)")
    p.add_argument("--server-token", default=os.environ.get("POLAR_SERVER_TOKEN"),
                   help="the rollout server's admin token (default: $POLAR_SERVER_TOKEN, else this node's token)")
    p.add_argument("--heartbeat", type=float, default=2.0, help="seconds between heartbeats to the server")
    p.add_argument("--runtime-option", action="append", default=[], metavar="KEY=JSON",
                   help="an option for every runtime backend (e.g. cli='[\"podman\",\"--runtime\",\"runc\"]', "
                        "memory_mb=2048); the only way options that reach the host's command line are set")
    p.add_argument("--expose-root", action="append", default=[], type=Path, metavar="DIR",
                   help="a host directory under which requests may expose paths read-only (runtime.options.expose)")
    return p.parse_args(argv)


def _runtime_options(items: list[str]) -> dict[str, object]:
    options: dict[str, object] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--runtime-option wants KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(text)
        except ValueError:
            options[key] = text  # a bare string
    return options


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    host = args.advertise_host or ("127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host)
    return GatewayConfig(workdir=args.workdir, endpoint=GatewayEndpoint(host, args.port),
                         init_workers=args.init_workers, ready_buffer=args.ready_buffer, run_slots=args.run_slots,
                         postrun_workers=args.postrun_workers, prewarm_workers=args.prewarm_workers,
                         postrun_grace_seconds=args.postrun_grace,
                         runtime_options=_runtime_options(getattr(args, "runtime_option", [])),
                         expose_roots=list(getattr(args, "expose_root", [])))


async def _serve(args: argparse.Namespace, admin_token: str) -> None:  # pragma: no cover - process glue
    service = build_service(args, allow_adhoc=False)
    config = config_from_args(args)
    node, app = build_gateway(service, config, admin_token)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=False, lifespan="off"))
    link = None
    if args.server_url:
        link = ServerLink(args.server_url, f"http://{config.endpoint.host}:{args.port}", args.run_slots,
                          server_token=args.server_token or admin_token, gateway_token=admin_token,
                          health=node.health, interval=args.heartbeat)
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if serving.done():  # could not listen: the await below raises why
                break
            await asyncio.sleep(0.05)
        if link is not None and server.started:
            link.start()
        await serving
    finally:
        if link is not None:
            await link.drain_and_close()
        await node.stop("gateway shut down")
        service.journal.close()


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - process glue
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per heartbeat
    admin_token = admin_token_from(args, args.workdir)
    asyncio.run(_serve(args, admin_token))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
