"""Standalone proxy.

    python -m polar_gym.proxy --engine {vllm,sglang,openai,oracle} --upstream URL [URL ...]
        --host 127.0.0.1 --port N --capture-dir DIR [--tokenizer DIR]

Standalone mode serves any key as an ad-hoc session of that name, so there the key is the session name, not a
secret (``--registered-only`` turns that off: ``POST /admin/sessions`` then answers each session's fresh key).
The admin token for ``/admin/*`` comes from ``--admin-token`` or ``POLAR_ADMIN_TOKEN``; otherwise a fresh one is
written to a file only its owner reads (``--admin-token-file``, default ``CAPTURE_DIR/admin-token`` or a private
temporary directory) and that file's path is printed: a token never goes to a log other users may read.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import uvicorn

from polar_gym.proxy.app import create_app
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.base import Engine
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry, new_admin_token
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.registry import ENGINES
from polar_gym.schema import OracleScript

__all__ = ["add_proxy_arguments", "admin_token_from", "build_engine", "build_service", "main", "parse_args",
           "write_secret"]


def add_proxy_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options every process that hosts the proxy takes (the standalone proxy and the gateway node)."""
    p.add_argument("--engine", default="vllm",
                   help="vllm, sglang, sglang_generate, openai, oracle, or a dotted path (pkg.module:Class)")
    p.add_argument("--upstream", nargs="*", default=[], help="inference server base URLs (not for oracle)")
    p.add_argument("--await-upstreams", action="store_true",
                   help="start without an upstream: calls wait (bounded) until one is added through /admin/upstreams "
                        "(or the rollout server's /backends), e.g. a trainer's policy server that starts later")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--capture-dir", type=Path, default=None, help="journal directory (default: in memory)")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer directory (oracle engine)")
    p.add_argument("--oracle-script", type=Path, default=None, help="JSON {commands: [...], final_answer: ...}")
    p.add_argument("--drift-every", type=int, default=0, help="oracle: non-canonical tokens every N calls")
    p.add_argument("--model-name", action="append", default=None, help="served model name(s) for /v1/models")
    p.add_argument("--policy-version", default=None)
    p.add_argument("--admin-token", default=os.environ.get("POLAR_ADMIN_TOKEN"))
    p.add_argument("--admin-token-file", type=Path, default=None,
                   help="without --admin-token: write the generated token here, mode 600 (its path is printed)")
    p.add_argument("--strict", action="store_true", help="reject unknown request fields instead of logging them")
    p.add_argument("--fsync", action="store_true", help="fsync every journal write")
    p.add_argument("--upstream-timeout", type=float, default=600.0)
    p.add_argument("--upstream-model", default=None,
                   help="model name sent upstream (harnesses send their own, e.g. claude-*, which the server lacks)")
    p.add_argument("--max-tokens-cap", type=int, default=None, help="clamp every call's max_tokens to this")
    p.add_argument("--log-level", default="info")
    return p


def write_secret(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable by its owner only: mode 600 also when the file existed with a wider one,
    and atomically (a reader polling for the file never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file left behind by a crash
        f.write(text)
    os.replace(tmp, path)
    return path


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


def build_service(args: argparse.Namespace, *, allow_adhoc: bool) -> ProxyService:
    """The proxy service those options describe."""
    return ProxyService(build_engine(args), CaptureJournal(args.capture_dir, fsync=args.fsync),
                        SessionRegistry(allow_adhoc=allow_adhoc), strict=args.strict, model_names=args.model_name,
                        max_tokens_cap=args.max_tokens_cap)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m polar_gym.proxy", description="polar_gym's token-capturing proxy")
    add_proxy_arguments(p)
    p.add_argument("--registered-only", action="store_true", help="serve only keys registered via /admin")
    return p.parse_args(argv)


def build_engine(args: argparse.Namespace) -> Engine:
    pool = UpstreamPool(list(args.upstream), policy_version=args.policy_version)
    if args.engine == "oracle":
        from polar_gym.proxy.tokenizer import HFChatTokenizer

        if args.tokenizer is None:
            raise SystemExit("--engine oracle needs --tokenizer DIR (python -m polar_gym.assets paths shows one)")
        script = OracleScript(**json.loads(args.oracle_script.read_text())) if args.oracle_script else None
        return OracleEngine(HFChatTokenizer(args.tokenizer), pool, default_script=script,
                            drift_every=args.drift_every)
    if not args.upstream and not getattr(args, "await_upstreams", False):
        raise SystemExit(f"--engine {args.engine} needs at least one --upstream URL (or --await-upstreams)")
    engine_cls = ENGINES.get(args.engine)
    kwargs = {"timeout": args.upstream_timeout, "upstream_model": args.upstream_model}
    if args.engine == "sglang_generate":
        from polar_gym.proxy.tokenizer import HFChatTokenizer

        if args.tokenizer is None:
            raise SystemExit("--engine sglang_generate renders prompts itself: it needs --tokenizer DIR")
        return engine_cls(HFChatTokenizer(args.tokenizer), pool, **kwargs)  # type: ignore[no-any-return]
    return engine_cls(pool, **kwargs)  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    admin_token = admin_token_from(args, args.capture_dir)
    service = build_service(args, allow_adhoc=not args.registered_only)
    uvicorn.run(create_app(service, admin_token), host=args.host, port=args.port, log_level=args.log_level,
                access_log=False)
    service.journal.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
