"""The standalone proxy's command line, parsed into :class:`~polar_gym.proxy.settings.ProxySettings`.

    python -m polar_gym.proxy --engine {vllm,sglang,openai,oracle} --upstream URL [URL ...]
        --host 127.0.0.1 --port N --capture-dir DIR [--tokenizer DIR]

Standalone mode serves any key as an ad-hoc session of that name, so there the key is the session name, not a
secret (``--registered-only`` turns that off: ``POST /admin/sessions`` then answers each session's fresh key).
The admin token for ``/admin/*`` comes from ``--admin-token`` or ``POLAR_ADMIN_TOKEN``; otherwise a fresh one is
written to a file only its owner reads (``--admin-token-file``, default ``CAPTURE_DIR/admin-token`` or a private
temporary directory) and that file's path is printed: a token never goes to a log other users may read.

Defaults are the settings model's (one source); a setting that cannot work exits like a bad flag (code 2) with the
flag named. The gateway's command line (``polar_gym.gateway.cli``) takes the same options.

The first line on stderr says the engine, the prompt mode it resolved (and why) and the upstreams. A token_in engine
then sends each upstream one one-token prompt: an upstream that answers but refuses it (a server that serves only
chat) stops the process with exit code 3 and a message saying to use ``--prompt-mode chat``; one that does not
answer yet is only warned about.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

import httpx
from pydantic import BaseModel

from polar_gym.private_files import write_secret
from polar_gym.proxy.engines.base import Engine
from polar_gym.proxy.errors import UpstreamError
from polar_gym.proxy.service import new_admin_token
from polar_gym.proxy.settings import ProxySettings, describe_mode
from polar_gym.settings import ConfigError, validate

__all__ = ["FLAGS", "UPSTREAM_REFUSED", "add_proxy_arguments", "admin_token_from", "build_parser", "config_exit",
           "main", "parse_args", "probe_token_upstreams", "settings_from_args", "start_up_probe"]

#: exit code of a process whose upstream refuses the prompts its mode sends (the launch's code for bad upstreams)
UPSTREAM_REFUSED = 3

#: settings field -> its flag, where the flag is not the field's name with dashes
FLAGS = {"upstreams": "--upstream", "model_names": "--model-name"}


def flag_of(field: str) -> str:
    """The command-line flag of a settings field (``upstreams`` -> ``--upstream``)."""
    return FLAGS.get(field, "--" + field.replace("_", "-"))


def _help(model: type[BaseModel], field: str) -> str:
    info = model.model_fields[field]
    return f"{info.description} (default: {info.get_default(call_default_factory=True, validated_data={})})"


def add_proxy_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options every process that hosts the proxy takes (the standalone proxy and the gateway node). The
    settings' options default to "not given", so the model's defaults apply (:func:`settings_from_args`)."""
    s = argparse.SUPPRESS
    p.add_argument("--engine", default=s, help=_help(ProxySettings, "engine"))
    p.add_argument("--upstream", dest="upstreams", nargs="*", default=s, metavar="URL",
                   help=_help(ProxySettings, "upstreams"))
    p.add_argument("--await-upstreams", action="store_true", default=s, help=_help(ProxySettings, "await_upstreams"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--capture-dir", type=Path, default=s, help=_help(ProxySettings, "capture_dir"))
    p.add_argument("--tokenizer", default=s, help=_help(ProxySettings, "tokenizer"))
    p.add_argument("--oracle-script", default=s, help=_help(ProxySettings, "oracle_script"))
    p.add_argument("--drift-every", type=int, default=s, help=_help(ProxySettings, "drift_every"))
    p.add_argument("--prompt-mode", choices=["token_in", "chat"], default=s, help=_help(ProxySettings, "prompt_mode"))
    p.add_argument("--parser", default=s, help=_help(ProxySettings, "parser"))
    p.add_argument("--model-name", dest="model_names", action="append", default=s, metavar="NAME",
                   help=_help(ProxySettings, "model_names"))
    p.add_argument("--policy-version", default=s, help=_help(ProxySettings, "policy_version"))
    p.add_argument("--admin-token", default=os.environ.get("POLAR_ADMIN_TOKEN"))
    p.add_argument("--admin-token-file", type=Path, default=None,
                   help="without --admin-token: write the generated token here, mode 600 (its path is printed)")
    p.add_argument("--strict", action="store_true", default=s, help=_help(ProxySettings, "strict"))
    p.add_argument("--fsync", action="store_true", default=s, help=_help(ProxySettings, "fsync"))
    p.add_argument("--upstream-timeout", type=float, default=s, help=_help(ProxySettings, "upstream_timeout"))
    p.add_argument("--upstream-model", default=s, help=_help(ProxySettings, "upstream_model"))
    p.add_argument("--max-tokens-cap", type=int, default=s, help=_help(ProxySettings, "max_tokens_cap"))
    p.add_argument("--stream-passthrough", action=argparse.BooleanOptionalAction, default=s,
                   help=_help(ProxySettings, "stream_passthrough"))
    p.add_argument("--session-idle-seconds", type=float, default=s, help=_help(ProxySettings, "session_idle_seconds"))
    p.add_argument("--max-adhoc-sessions", type=int, default=s, help=_help(ProxySettings, "max_adhoc_sessions"))
    p.add_argument("--max-images", type=int, default=s, help=_help(ProxySettings, "max_images"))
    p.add_argument("--max-image-bytes", type=int, default=s, help=_help(ProxySettings, "max_image_bytes"))
    p.add_argument("--log-level", default="info")
    return p


def settings_from_args(args: argparse.Namespace) -> ProxySettings:
    """The proxy settings the given flags describe (the model's defaults for the others); ConfigError names the
    flag."""
    given: dict[str, Any] = {k: v for k, v in vars(args).items() if k in ProxySettings.model_fields}
    try:
        return validate(ProxySettings, given)
    except ConfigError as exc:
        raise exc.renamed(flag_of) from None


def config_exit(parser: argparse.ArgumentParser, exc: ConfigError) -> NoReturn:
    """A ConfigError as the CLI's usual exit for a bad flag (usage, the message with flag names, code 2)."""
    parser.error(str(exc.renamed(lambda key: flag_of(key) if key and not key.startswith("-") else key)))


def admin_token_from(args: argparse.Namespace, default_dir: Path | None) -> str:
    """The admin token of a proxy or gateway process: the given one, or a fresh one written to a private file whose
    path (never the token) is printed to stderr."""
    if args.admin_token:
        return str(args.admin_token)
    token = new_admin_token()
    path = args.admin_token_file
    if path is None:
        path = (default_dir if default_dir is not None else Path(tempfile.mkdtemp(prefix="polar_gym-"))) / "admin-token"
    write_secret(path, token + "\n")
    print(f"admin token written to {path} (mode 600)", file=sys.stderr, flush=True)
    return token


async def probe_token_upstreams(engine: Engine, urls: list[str], *, timeout: float = 30.0,
                                client: httpx.AsyncClient | None = None) -> tuple[list[str], list[str]]:
    """Send each upstream of a token-in engine one minimal token prompt: the messages of those that answered but
    refused it, and one warning per upstream that did not answer (it may start later). Nothing to say for other
    engines. Through a client of its own (``client``: a given one), not the engine's, which serves later calls."""
    from polar_gym.proxy.engines.tokenin import TokenInEngine

    if not isinstance(engine, TokenInEngine) or not urls:
        return [], []
    http = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0), trust_env=False)

    async def one(url: str) -> tuple[str | None, str | None]:
        try:
            return await engine.probe_token_prompt(url, client=http), None
        except UpstreamError as exc:
            return None, f"{exc.message}; not checked whether it takes token prompts (it may start later)"

    try:
        results = await asyncio.gather(*(one(url.rstrip("/")) for url in urls))
    finally:
        if client is None:
            await http.aclose()
    return [r for r, _ in results if r is not None], [w for _, w in results if w is not None]


def start_up_probe(engine: Engine, urls: list[str], prog: str) -> int:
    """:func:`probe_token_upstreams` at a process's start, its lines printed to stderr: :data:`UPSTREAM_REFUSED`
    when an upstream refused token prompts, else 0."""
    refused, silent = asyncio.run(probe_token_upstreams(engine, urls))
    for line in silent:
        print(f"{prog}: warning: {line}", file=sys.stderr, flush=True)
    for line in refused:
        print(f"{prog}: {line}", file=sys.stderr, flush=True)
    return UPSTREAM_REFUSED if refused else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m polar_gym.proxy", description="polar_gym's token-capturing proxy")
    add_proxy_arguments(p)
    p.add_argument("--registered-only", action="store_true", help="serve only keys registered via /admin")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - process glue
    import uvicorn

    from polar_gym.proxy.app import create_app, tune_gc_for_serving
    from polar_gym.proxy.settings import build_service, check_engine
    from polar_gym.serving import CoalescingHttpProtocol

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
        check_engine(settings)
        print(describe_mode(settings, "proxy"), file=sys.stderr, flush=True)  # the first line: the run's mode
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        service = build_service(settings, allow_adhoc=not args.registered_only)
    except ConfigError as exc:
        config_exit(parser, exc)
    if code := start_up_probe(service.engine, settings.upstreams, "polar_gym proxy"):
        service.journal.close()
        return code
    admin_token = admin_token_from(args, settings.capture_dir)
    app = create_app(service, admin_token)
    tune_gc_for_serving()
    # No X-Forwarded-* rewriting (nothing reads the client address) and no access log: less work per call.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False, proxy_headers=False,
                http=CoalescingHttpProtocol)
    service.journal.close()
    return 0
