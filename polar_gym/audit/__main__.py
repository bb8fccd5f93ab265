"""``python -m polar_gym.audit --model DIR RUN_OR_TRACES``: the training/inference mismatch audit.

Recomputes with transformers the logprob of every trained (mask-1) token of every trace and compares it with the
logprob the engine reported; prints per-trace and run metrics under verl's names, writes audit.jsonl and
audit_summary.json, exits 1 when a threshold is past (2: nothing could be audited).

    python -m polar_gym.audit --model ckpt/ runs/step3/                  # one model for every version
    # each span audited with the weights of the version that sampled it:
    python -m polar_gym.audit --model 0=ckpt0/ --model 1=ckpt1/ traces.jsonl
    # what a bf16 trainer with an fp32 output layer would measure against the same captures:
    python -m polar_gym.audit --model ckpt/ --dtype bfloat16 --lm-head-fp32 runs/step3/
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from polar_gym.audit.core import AuditSettings, AuditThresholds
from polar_gym.audit.recompute import DTYPES
from polar_gym.audit.report import EXIT_FAILED, EXIT_NOTHING, EXIT_OK, parse_models, print_report, run_audit


def _limit(text: str) -> float | None:
    return None if text.lower() in ("none", "off") else float(text)


def main(argv: list[str] | None = None) -> int:
    t, s = AuditThresholds(), AuditSettings(models={})
    p = argparse.ArgumentParser(prog="python -m polar_gym.audit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="RUN_OR_TRACES",
                   help="a launch output folder (trajectories.jsonl) or a JSONL of traces or Slime samples")
    p.add_argument("--model", action="append", default=[], metavar="[VERSION=]DIR", required=True,
                   help="model directory; VERSION=DIR audits the spans that policy version sampled (repeatable)")
    p.add_argument("--dtype", choices=DTYPES, default=s.dtype, help="recompute dtype (default %(default)s)")
    p.add_argument("--lm-head-fp32", action="store_true",
                   help="the output layer in fp32 whatever --dtype (what trainer.lm_head_fp32 trains with)")
    p.add_argument("--device", default=s.device, help="torch device, e.g. cuda:0 (default %(default)s)")
    p.add_argument("--out", default=None, help="where audit.jsonl and audit_summary.json go (default: next to "
                                                "the input)")
    p.add_argument("--chunk-tokens", type=int, default=s.chunk_tokens, help="decoder chunk (default %(default)s)")
    p.add_argument("--head-rows", type=int, default=s.head_rows, help="output-layer rows at once (default "
                                                                       "%(default)s)")
    p.add_argument("--outlier-abs-diff", type=float, default=s.outlier_abs_diff,
                   help="report tokens whose |Δ logprob| is past this (default %(default)s)")
    p.add_argument("--max-outliers", type=int, default=s.max_outliers, help="per trace and run (default %(default)s)")
    p.add_argument("--max-kl", type=_limit, default=t.max_k3_kl, help="k3 KL limit (default %(default)s; 'off')")
    p.add_argument("--max-abs-diff", type=_limit, default=t.max_abs_diff,
                   help="max |Δ logprob| limit (default %(default)s; 'off')")
    p.add_argument("--min-pearson", type=_limit, default=t.min_pearson,
                   help="Pearson of token probabilities, lower limit (default %(default)s; 'off')")
    p.add_argument("--max-ratio-fraction-high", type=_limit, default=t.max_ratio_fraction_high,
                   help="share of importance ratios above --is-threshold (default %(default)s; 'off')")
    p.add_argument("--max-nonfinite", type=_limit, default=t.max_nonfinite_tokens,
                   help="tokens with a -inf/NaN logprob (default %(default)s; 'off')")
    p.add_argument("--is-threshold", type=float, default=t.is_threshold, help="importance ratio counted as high "
                                                                              "(default %(default)s)")
    args = p.parse_args(argv)
    console = Console()
    if not console.is_terminal:  # piped or logged: wide enough that the numbers are never cut
        console = Console(width=max(console.width, 160))
    try:
        settings = AuditSettings(models=parse_models(args.model), dtype=args.dtype, lm_head_fp32=args.lm_head_fp32,
                                 device=args.device,
                                 chunk_tokens=args.chunk_tokens, head_rows=args.head_rows,
                                 outlier_abs_diff=args.outlier_abs_diff, max_outliers=args.max_outliers)
        thresholds = AuditThresholds(
            max_k3_kl=args.max_kl, max_abs_diff=args.max_abs_diff, min_pearson=args.min_pearson,
            max_ratio_fraction_high=args.max_ratio_fraction_high,
            max_nonfinite_tokens=None if args.max_nonfinite is None else int(args.max_nonfinite),
            is_threshold=args.is_threshold)
        audits, summary, out = run_audit(args.source, settings, thresholds, args.out)
    except (OSError, ValueError) as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        return EXIT_NOTHING
    print_report(console, audits, summary)
    console.print(f"files in {out}", highlight=False)
    if summary.audited == 0:
        return EXIT_NOTHING
    return EXIT_OK if summary.passed else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
