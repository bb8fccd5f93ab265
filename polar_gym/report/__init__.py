"""The run report: report.html, one self-contained page per run (sessions by status and cause, rewards, stage
timings and run-slot use, token fidelity, harness failures, the resolved config), written by every launch and
rebuilt from a finished run's folder by ``python -m polar_gym.report OUT_DIR``.

Layers inside: :mod:`.causes` and :mod:`.model` are pure data; :mod:`.figures` draws with matplotlib (loaded on
first use); :mod:`.render` writes the HTML; :mod:`.files` reads a run's folder and writes the file."""

from __future__ import annotations

from polar_gym.causes import INFRA_CAUSES, error_cause, harness_failed, stderr_tail
from polar_gym.report.files import build_report, load_run, write_report
from polar_gym.report.model import HarnessFailureRow, RunData, SessionRow

__all__ = ["INFRA_CAUSES", "HarnessFailureRow", "RunData", "SessionRow", "build_report", "error_cause",
           "harness_failed", "load_run", "stderr_tail", "write_report"]
