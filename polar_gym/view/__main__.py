"""``python -m polar_gym.view OUT_DIR [--host 127.0.0.1] [--port N]``: serve the trace viewer of a run's folder
and print its URL, which carries a token made at start (see polar_gym.view.app)."""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m polar_gym.view", description="the trace viewer of a polar_gym run")
    p.add_argument("out_dir", type=Path, help="a launch's out_dir (results.jsonl, trajectories.jsonl, capture/)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    p.add_argument("--port", type=int, default=None, help="port (default 8765 if free, else any free port; 0: any "
                                                          "free port; a port named here that is taken: exit 2)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer directory to decode ids (default: the run's, else "
                                                  "the cached Qwen tokenizer)")
    p.add_argument("--ids", action="store_true", help="show token ids, do not decode")
    p.add_argument("--token-file", type=Path, help="read the viewer's token from this file (default: a fresh "
                                                    "random token, printed in the URL)")
    p.add_argument("--no-token", action="store_true", help="no token at all: anyone who reaches the port reads "
                                                          "the run (a single-user machine only)")
    args = p.parse_args(argv)
    if not (args.out_dir / "results.jsonl").is_file():
        p.error(f"{args.out_dir} has no results.jsonl: give a launch's out_dir")
    if args.no_token and args.token_file:
        p.error("--no-token and --token-file exclude each other")
    if args.token_file:
        try:
            args.token = args.token_file.read_text().strip()
        except OSError as exc:
            p.error(f"--token-file {args.token_file}: {exc.strerror}")
        if not args.token:
            p.error(f"--token-file {args.token_file} is empty")
    else:
        args.token = None if args.no_token else secrets.token_urlsafe(24)
    return args


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - process glue
    import asyncio

    from polar_gym.view.serve import PortTaken, serve_forever

    args = parse_args(argv)
    try:
        asyncio.run(serve_forever(args.out_dir, args.host, args.port, tokenizer=args.tokenizer, decode=not args.ids,
                                  token=args.token))
    except PortTaken as exc:
        print(f"error: {exc.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
