"""``python -m polar_gym.env``: the Polar side of the NeMo Gym plugin (the Gym side lives in this folder's
``responses_api_agents/`` and ``resources_servers/``, see README.md here).

    serve     a rollout server + one local gateway until SIGINT / SIGTERM (the agent starts it when no
              polar_server_url is configured); writes {"url", "admin_token", "pid"} to --info-file
    request   rows' ``polar_task`` objects (JSON lines on stdin) to TaskRequest JSON lines on stdout; a row that
              cannot be one gives {"error": "..."} on its line
    conformance
              NeMo Gym 0.7's token-capture conformance suite (lineage checks on) against polar_gym's journal
              transport, in Gym's interpreter; prints each check that passed; exit 0 only if all did
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from pydantic import ValidationError

__all__ = ["main"]


#: InferenceSettings field -> its flag here, where it is not the field's name with dashes
_FLAGS = {"upstreams": "--upstream"}


def _flag(field: str) -> str:
    return _FLAGS.get(field, "--" + field.replace("_", "-")) if field else field


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from polar_gym.env.serve import serve
    from polar_gym.fleet import InferenceSettings
    from polar_gym.gateway.config import GatewayPools
    from polar_gym.settings import ConfigError, validate

    given = {k: v for k, v in vars(args).items() if k in InferenceSettings.model_fields}
    # --run-slots N sizes every pool the same (a small local fleet); without it, the gateway's defaults
    sizes = {} if args.run_slots is None else {name: args.run_slots for name in
                                               ("run_slots", "ready_buffer", "init_workers", "postrun_workers")}
    try:
        inference = validate(InferenceSettings, given)
        pools = validate(GatewayPools, sizes)
    except ConfigError as exc:
        parser.error(str(exc.renamed(lambda key: "--run-slots" if key in sizes else _flag(key))))
    out_dir = Path(args.out_dir) if args.out_dir else Path(tempfile.mkdtemp(prefix="polar_gym_env_serve_"))
    try:
        asyncio.run(serve(out_dir, inference, info_file=Path(args.info_file) if args.info_file else None,
                          host=args.host, server_port=args.port, pools=pools, parent_pid=args.parent_pid))
    except ConfigError as exc:
        parser.error(str(exc.renamed(lambda key: _flag(key.removeprefix("inference.")))))
    return 0


def _request(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from polar_gym.env.tasks import EnvTemplate, task_request

    template = EnvTemplate.model_validate(json.loads(args.template)) if args.template else EnvTemplate()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            out = task_request(json.loads(line), template).model_dump_json()
        except (ValueError, ValidationError) as exc:
            out = json.dumps({"error": str(exc)})
        sys.stdout.write(out + "\n")
        sys.stdout.flush()
    return 0


def _conformance(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from polar_gym.assets import nemo_gym_python
    from polar_gym.env.conformance import conformance_command

    gym_python = Path(args.gym_python) if args.gym_python else nemo_gym_python()
    try:
        return conformance_command(gym_python, transport=args.transport, root=args.root)
    except FileNotFoundError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m polar_gym.env", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="a rollout server + one local gateway, until SIGINT / SIGTERM")
    serve.add_argument("--out-dir", help="store, captures and sandboxes (default: a new temporary directory)")
    serve.add_argument("--info-file", help="write {url, admin_token, pid} here once the gateway is registered")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0, help="rollout server port (0: a free one)")
    # the inference settings' flags default to "not given": InferenceSettings' own defaults apply
    s = argparse.SUPPRESS
    serve.add_argument("--engine", default=s, help="proxy engine: oracle (default), vllm, sglang, openai, ...")
    serve.add_argument("--upstream", dest="upstreams", action="append", default=s,
                       help="inference server URL (repeatable)")
    serve.add_argument("--upstream-model", default=s)
    serve.add_argument("--await-upstreams", action="store_true", default=s,
                       help="start without an upstream: the policy arrives through POST /backends (the agent's "
                            "register_policy_backend)")
    serve.add_argument("--tokenizer", default=s)
    serve.add_argument("--prompt-mode", choices=["token_in", "chat"], default=s,
                       help="oracle/vllm/sglang: token_in (exact prefix token IDs) or chat (default: token_in "
                       "for oracle, and for vllm/sglang when --tokenizer is set; else chat)")
    serve.add_argument("--parser", default=s,
                       help="token_in: the output parser (default: qwen3 for the Qwen tokenizer)")
    serve.add_argument("--max-tokens-cap", type=int, default=s, help="clamp every call's max_tokens to this")
    serve.add_argument("--run-slots", type=int, default=None,
                       help="size of every gateway pool (default: the gateway's own pool sizes)")
    serve.add_argument("--parent-pid", type=int, default=None, help="stop when this process is gone")
    serve.set_defaults(func=_serve)
    request = sub.add_parser("request", help="polar_task JSON lines (stdin) to TaskRequest JSON lines (stdout)")
    request.add_argument("--template", default=None, help="JSON of polar_gym.env.tasks.EnvTemplate")
    request.set_defaults(func=_request)
    conformance = sub.add_parser("conformance", help="NeMo Gym's token-capture conformance suite against the "
                                 "journal transport (polar_gym.env.nemo_transport)")
    conformance.add_argument("--gym-python", help="NeMo Gym's interpreter (default: the venv polar_gym.assets "
                             "builds)")
    conformance.add_argument("--root", help="the transport's directory (default: a new temporary one)")
    conformance.add_argument("--transport", help="module:Name of a JournalTokenStore subclass to check instead")
    conformance.set_defaults(func=_conformance)
    args = parser.parse_args(argv)
    return int(args.func(args, parser))


if __name__ == "__main__":
    sys.exit(main())
