"""The gateway node's command line, parsed into :class:`~polar_gym.proxy.settings.ProxySettings` and
:class:`~polar_gym.gateway.config.GatewayConfig`.

    python -m polar_gym.gateway --engine {vllm,sglang,openai,oracle} [--upstream URL ...] --port N
        --capture-dir DIR --workdir DIR [--init-workers N --ready-buffer N --run-slots N --postrun-workers N]
        [--runtime-option KEY=JSON ...] [--expose-root DIR ...]
        [--otlp-endpoint URL] [--telemetry-file PATH] [--telemetry-resource KEY=VALUE ...]

With ``--server-url`` the node registers with a rollout server once it listens, pushes its stage metrics as
heartbeats and registers again if the server forgot it. Only registered sessions are served. The admin token (for
POST /sessions, cancel, drain, /admin/*) comes from ``--admin-token`` or ``POLAR_ADMIN_TOKEN``; otherwise a fresh
one is written to ``--admin-token-file`` (default ``WORKDIR/admin-token``, mode 600) and only that path is printed,
so the token never lands in a job log other users can read. On SIGINT/SIGTERM the server stops and every live
session is cancelled and torn down; POST /gateway/drain?wait=true first for a graceful end.

The first line on stderr says the engine, its prompt mode and the upstreams; a token_in node whose upstream refuses
token prompts exits with code 3 before it registers (see :mod:`polar_gym.proxy.cli`).

With ``--otlp-endpoint`` (default ``$OTEL_EXPORTER_OTLP_ENDPOINT``) or ``--telemetry-file`` every finished session's
OpenTelemetry spans (session, stages, model calls; :mod:`polar_gym.gateway.telemetry`) are exported in the
background.

Pool defaults are :class:`~polar_gym.gateway.config.GatewayPools`' (one source); a Slurm gateway job calls
:func:`main` with its argv.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from polar_gym.gateway.config import GatewayConfig, GatewayPools
from polar_gym.proxy.cli import (
    add_proxy_arguments,
    admin_token_from,
    config_exit,
    flag_of,
    settings_from_args,
    start_up_probe,
)
from polar_gym.proxy.service import ProxyService
from polar_gym.proxy.settings import build_service, check_engine, describe_mode
from polar_gym.runtime.base import GatewayEndpoint
from polar_gym.settings import ConfigError, validate
from polar_gym.telemetry import TelemetrySettings

__all__ = ["build_parser", "config_from_args", "main", "parse_args", "telemetry_from_args"]

#: GatewayPools field -> its flag, where it is not the field's name with dashes
_POOL_FLAGS = {"postrun_grace_seconds": "--postrun-grace", "runtime_options": "--runtime-option",
               "expose_roots": "--expose-root"}


def _pool_help(field: str) -> str:
    info = GatewayPools.model_fields[field]
    default = info.get_default(call_default_factory=True, validated_data={})
    return f"{info.description} (default: {default})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m polar_gym.gateway", description="polar_gym's gateway node")
    add_proxy_arguments(p)
    s = argparse.SUPPRESS
    p.add_argument("--advertise-host", default=None,
                   help="the host runtimes use to reach this node (default: --host, or 127.0.0.1 for 0.0.0.0)")
    p.add_argument("--workdir", type=Path, default=Path("polar_gym-gateway"), help="per-session directories")
    for field in ("init_workers", "ready_buffer", "run_slots", "postrun_workers", "prewarm_workers"):
        p.add_argument("--" + field.replace("_", "-"), type=int, default=s, help=_pool_help(field))
    p.add_argument("--postrun-grace", dest="postrun_grace_seconds", type=float, default=s,
                   help=_pool_help("postrun_grace_seconds"))
    p.add_argument("--pool-sizing", choices=("fixed", "auto"), default=s, help=_pool_help("pool_sizing"))
    p.add_argument("--max-runtimes", type=int, default=s, help=_pool_help("max_runtimes"))
    p.add_argument("--server-url", default=os.environ.get("POLAR_SERVER_URL"),
                   help="rollout server to register with and heartbeat to (default: $POLAR_SERVER_URL, else none); "
                        "several server workers: their URLs, comma-separated, this gateway's own first (it moves to "
                        "the next when its own stops answering)")
    p.add_argument("--server-token", default=os.environ.get("POLAR_SERVER_TOKEN"),
                   help="the rollout server's admin token (default: $POLAR_SERVER_TOKEN, else this node's token)")
    p.add_argument("--heartbeat", type=float, default=2.0, help="seconds between heartbeats to the server")
    p.add_argument("--runtime-option", dest="runtime_option", action="append", default=[], metavar="KEY=JSON",
                   help="an option for every runtime backend (e.g. cli='[\"podman\",\"--runtime\",\"runc\"]', "
                        "memory_mb=2048); the only way options that reach the host's command line are set")
    p.add_argument("--expose-root", dest="expose_root", action="append", default=[], type=Path, metavar="DIR",
                   help="a host directory under which requests may expose paths read-only (runtime.options.expose)")
    t = p.add_argument_group("telemetry", "OpenTelemetry spans of every finished session (its stages, its model calls)")
    t.add_argument("--otlp-endpoint", default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
                   help="an OTLP/HTTP collector, e.g. http://127.0.0.1:4318 (default: $OTEL_EXPORTER_OTLP_ENDPOINT)")
    t.add_argument("--telemetry-file", default=None, help="also write every span as a JSON line to this file")
    t.add_argument("--telemetry-service-name", default=s, help="the spans' service.name (default: polar_gym-gateway)")
    t.add_argument("--telemetry-timeout", type=float, default=s, help="seconds one export may take (default: 5)")
    t.add_argument("--telemetry-resource", action="append", default=[], metavar="KEY=VALUE",
                   help="a resource attribute of every span (e.g. polar_gym.launch_id=...)")
    return p


def telemetry_from_args(args: argparse.Namespace) -> TelemetrySettings | None:
    """The node's telemetry settings from its flags (None: no exporter asked for)."""
    if not (getattr(args, "otlp_endpoint", None) or getattr(args, "telemetry_file", None)):
        return None
    given: dict[str, Any] = {"otlp_endpoint": args.otlp_endpoint, "file": args.telemetry_file}
    for field, name in (("service_name", "telemetry_service_name"), ("export_timeout_seconds", "telemetry_timeout")):
        if hasattr(args, name):
            given[field] = getattr(args, name)
    resource: dict[str, str] = {}
    for item in args.telemetry_resource:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"wants KEY=VALUE, got {item!r}", key="--telemetry-resource")
        resource[key] = value
    flags = {"otlp_endpoint": "--otlp-endpoint", "file": "--telemetry-file",
             "service_name": "--telemetry-service-name", "export_timeout_seconds": "--telemetry-timeout"}
    try:
        return validate(TelemetrySettings, {**given, "resource": resource})
    except ConfigError as exc:
        raise exc.renamed(lambda key: flags.get(key, key)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _runtime_options(items: list[str]) -> dict[str, object]:
    options: dict[str, object] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"wants KEY=VALUE, got {item!r}", key="--runtime-option")
        try:
            options[key] = json.loads(text)
        except ValueError:
            options[key] = text  # a bare string
    return options


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The node's config from its flags (the model's defaults for the pools not given); ConfigError names the
    flag."""
    host = args.advertise_host or ("127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host)
    given: dict[str, Any] = {k: v for k, v in vars(args).items() if k in GatewayPools.model_fields}
    given["runtime_options"] = _runtime_options(getattr(args, "runtime_option", []))
    given["expose_roots"] = list(getattr(args, "expose_root", []))
    try:
        pools = validate(GatewayPools, given)
    except ConfigError as exc:
        raise exc.renamed(lambda key: _POOL_FLAGS.get(key, flag_of(key))) from None
    return GatewayConfig(workdir=args.workdir, endpoint=GatewayEndpoint(host, args.port),
                         telemetry=telemetry_from_args(args), **dict(pools))


async def serve_gateway(service: ProxyService, config: GatewayConfig, args: argparse.Namespace,
                        admin_token: str) -> None:  # pragma: no cover - process glue
    """Serve the node on ``args.host:args.port`` until stopped; registered with ``args.server_url`` if given."""
    import uvicorn

    from polar_gym.gateway.api import build_gateway
    from polar_gym.gateway.registration import ServerLink
    from polar_gym.proxy.app import tune_gc_for_serving
    from polar_gym.serving import CoalescingHttpProtocol

    node, app = build_gateway(service, config, admin_token)
    tune_gc_for_serving()  # issue 18: the start-up heap out of the cyclic collector's sight
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=False, lifespan="off", http=CoalescingHttpProtocol))
    link = None
    if args.server_url and config.endpoint is not None:
        link = ServerLink(args.server_url, f"http://{config.endpoint.host}:{args.port}", config.dispatch_capacity(),
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
    """The gateway process: flags in, a node served until SIGINT / SIGTERM (also what a Slurm gateway job runs)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
        config = config_from_args(args)
        check_engine(settings)  # before anything is written (the admin token file)
        print(describe_mode(settings, "gateway"), file=sys.stderr, flush=True)  # the first line: the node's mode
    except ConfigError as exc:
        config_exit(parser, exc)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per heartbeat
    try:
        service = build_service(settings, allow_adhoc=False)
    except ConfigError as exc:
        config_exit(parser, exc)
    if code := start_up_probe(service.engine, settings.upstreams, "polar_gym gateway"):
        service.journal.close()  # before it registers: a server must not dispatch to a node that cannot sample
        return code
    admin_token = admin_token_from(args, args.workdir)
    try:
        asyncio.run(serve_gateway(service, config, args, admin_token))
    except ConfigError as exc:
        config_exit(parser, exc)
    return 0
