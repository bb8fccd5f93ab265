"""Mutation testing for the pure cores (issue 20): write one small bug at a time into a module (a comparison or
boolean operator flipped, an arithmetic operator swapped, a constant nudged, a statement deleted, a return value
replaced), run the tests that cover that module, and report which bugs no test noticed.

A small mutator of our own (``ast``, no dependency): mutmut and cosmic-ray both want their own configuration and
runner layout, and neither runs a module against a chosen set of test files in parallel copies of the tree.

Each worker owns a copy of the tree (``polar_gym``, ``tests``, ``pyproject.toml``) in a scratch directory and
imports from it (``PYTHONPATH`` comes before the editable install); a mutant is a source edit of one expression or
statement, so lines, comments and the rest of the file stay as they are. A mutant is *killed* when the tests fail
(or do not even import), *timeout* when they run past ``--timeout-factor`` x the unmutated run (an infinite loop;
counted with the killed, as "killed or hung"), *survived* when they pass, and *equivalent* when it is listed in
``EQUIVALENT`` (a mutant no test can tell apart: left out of the score, named in the report).

Not in CI (a module takes minutes): run it before changing a core module, e.g.::

    nice -n 19 .venv/bin/python scripts/mutate.py --module merge/base.py --jobs 2 --json /tmp/mutate.json
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from queue import Queue

__all__ = ["EQUIVALENT", "MODULE_TESTS", "ModuleResult", "Mutant", "Outcome", "apply", "mutants", "run_module"]

ROOT = Path(__file__).resolve().parent.parent

#: the pass-through stream renderers' tests: the renderers driven piece by piece, and the proxy streaming through them
_STREAM_TESTS = ("tests/unit/test_stream_renderers.py", "tests/unit/test_stream_passthrough.py",
                 "tests/unit/test_stream_chat_mode.py", "tests/unit/test_stream_first_byte.py")

#: module (under polar_gym/) -> the test files that cover it; a module's score is against these only
MODULE_TESTS: dict[str, tuple[str, ...]] = {
    "journal.py": ("tests/unit/test_capture.py", "tests/unit/test_capture_attempts.py", "tests/unit/test_journal.py",
                   "tests/unit/test_edited_history_route.py", "tests/unit/test_known_json.py",
                   "tests/unit/test_known_conversations.py"),
    "proxy/capture.py": ("tests/unit/test_capture.py", "tests/unit/test_capture_attempts.py",
                         "tests/unit/test_journal.py", "tests/unit/test_session_state.py",
                         "tests/unit/test_edited_history_route.py", "tests/unit/test_proxy_faults.py",
                         "tests/unit/test_capture_writer.py"),
    "merge/base.py": ("tests/merge/test_cases.py", "tests/merge/test_pinned.py", "tests/merge/test_properties.py"),
    "merge/prefix_merging.py": ("tests/merge/test_prefix_pinned.py", "tests/merge/test_cases.py",
                                "tests/merge/test_pinned.py", "tests/merge/test_properties.py",
                                "tests/merge/test_real_sessions.py"),
    "merge/per_request.py": ("tests/merge/test_cases.py", "tests/merge/test_pinned.py"),
    "merge/exports.py": ("tests/merge/test_exports.py",),
    "merge/rewards.py": ("tests/merge/test_rewards.py",),
    "dirnames.py": ("tests/unit/test_dirnames.py",),
    "known_json.py": ("tests/unit/test_known_json.py", "tests/unit/test_known_conversations.py",
                      "tests/unit/test_known_prompt_ids.py"),
    "known_prompt_ids.py": ("tests/unit/test_known_prompt_ids.py",),
    "proxy/upstream_http.py": ("tests/unit/test_upstream_http.py",),
    "launch/slurm.py": ("tests/launch/test_slurm_render.py", "tests/launch/test_token_files.py"),
    "proxy/providers/anthropic/translate.py": ("tests/unit/test_anthropic_translate.py",
                                               "tests/unit/test_anthropic_malformed.py"),
    "proxy/providers/google/translate.py": ("tests/unit/test_google_translate.py",
                                            "tests/unit/test_google_translate_pinned.py"),
    "proxy/providers/openai_responses/translate.py": ("tests/unit/test_responses_translate.py",
                                                      "tests/unit/test_responses_translate_pinned.py"),
    "proxy/providers/openai_chat/translate.py": ("tests/unit/test_openai_chat_translate.py",),
    "proxy/providers/stream.py": _STREAM_TESTS,
    "proxy/providers/anthropic/stream.py": _STREAM_TESTS,
    "proxy/providers/openai_chat/stream.py": _STREAM_TESTS,
    "proxy/providers/openai_responses/stream.py": _STREAM_TESTS,
    "proxy/providers/google/stream.py": _STREAM_TESTS,
    "proxy/providers/openai_responses/render.py": ("tests/unit/test_responses_translate.py", *_STREAM_TESTS),
}

#: mutants shown equivalent (no behaviour can tell them apart): (module, the stripped source line, mutation) -> why;
#: kept as data in scripts/mutation-equivalents.toml
EQUIVALENT: dict[tuple[str, str, str], str] = {
    (e["module"], e["line"], e["mutation"]): e["why"]
    for e in tomllib.loads((ROOT / "scripts" / "mutation-equivalents.toml").read_text())["equivalent"]
}

_COMPARE_SWAPS: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
}
_BINOP_SWAPS: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult, ast.Div: ast.Mult,
    ast.Mod: ast.FloorDiv,
}
_SYMBOLS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.In: "in",
            ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not", ast.Add: "+", ast.Sub: "-", ast.Mult: "*",
            ast.FloorDiv: "//", ast.Div: "/", ast.Mod: "%", ast.And: "and", ast.Or: "or"}
_DELETABLE = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Break, ast.Continue, ast.Raise)


@dataclass(frozen=True)
class Mutant:
    """One source edit: replace ``source[start:end]`` with ``replacement``."""

    line: int
    start: int
    end: int
    replacement: str
    description: str


@dataclass
class Outcome:
    mutant: Mutant
    verdict: str  # killed | timeout | survived | equivalent
    seconds: float
    why: str = ""


@dataclass
class ModuleResult:
    module: str
    tests: tuple[str, ...]
    baseline_seconds: float
    outcomes: list[Outcome] = field(default_factory=list)
    source: str = ""

    def count(self, verdict: str) -> int:
        return sum(1 for o in self.outcomes if o.verdict == verdict)

    @property
    def score(self) -> float:
        """Killed or hung over the mutants run, equivalent ones left out."""
        run = len(self.outcomes) - self.count("equivalent")
        return 100.0 * (self.count("killed") + self.count("timeout")) / run if run else 100.0

    def to_json(self) -> dict[str, object]:
        return {"module": self.module, "tests": list(self.tests), "baseline_seconds": round(self.baseline_seconds, 2),
                "mutants": len(self.outcomes), "killed": self.count("killed"), "timeout": self.count("timeout"),
                "survived": self.count("survived"), "equivalent": self.count("equivalent"),
                "score": round(self.score, 1),
                "survivors": [self._where(o) for o in self.outcomes if o.verdict == "survived"],
                "timeouts": [self._where(o) for o in self.outcomes if o.verdict == "timeout"],
                "equivalents": [self._where(o) for o in self.outcomes if o.verdict == "equivalent"]}

    def _where(self, outcome: Outcome) -> dict[str, object]:
        where: dict[str, object] = {"at": f"polar_gym/{self.module}:{outcome.mutant.line}",
                                    "mutation": outcome.mutant.description,
                                    "key": list(mutant_keys(self.source)[outcome.mutant])}
        if outcome.why:
            where["why"] = outcome.why
        return where


def mutant_keys(source: str) -> dict[Mutant, tuple[str, int, str, int]]:
    """What names each mutant of ``source`` across edits elsewhere in the file: its line's text, its column, its
    mutation, and which of the mutants alike in those three it is (two ``continue`` lines at one indent)."""
    keys: dict[Mutant, tuple[str, int, str, int]] = {}
    seen: dict[tuple[str, int, str], int] = {}
    for mutant in mutants(source):
        line_start = source.rfind("\n", 0, mutant.start) + 1
        alike = (source_line(source, mutant), mutant.start - line_start, mutant.description)
        seen[alike] = seen.get(alike, -1) + 1
        keys[mutant] = (*alike, seen[alike])
    return keys


# -------------------------------------------------------------------------------------------- the mutator (pure)


def _offsets(source: str) -> list[int]:
    starts, total = [0], 0
    for line in source.splitlines(keepends=True):
        total += len(line)
        starts.append(total)
    return starts


def _skipped(tree: ast.Module) -> set[int]:
    """Nodes never mutated: docstrings, annotations, decorators, ``__all__``, f-string pieces."""
    skip: set[int] = set()

    def mark(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            mark(body[0])
        if isinstance(node, (ast.AnnAssign, ast.arg)):
            mark(node.annotation)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            mark(node.returns)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for decorator in node.decorator_list:  # frozen=True, lru_cache sizes: not behaviour a test states
                mark(decorator)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            mark(node)
        if isinstance(node, ast.JoinedStr):
            mark(node)
    return skip


def _expression_edits(node: ast.AST) -> Iterator[tuple[ast.expr, str]]:
    """Mutated copies of one expression node, with what was changed."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            swap = _COMPARE_SWAPS.get(type(op))
            if swap is not None:
                ops = list(node.ops)
                ops[i] = swap()
                yield (ast.Compare(left=node.left, ops=ops, comparators=node.comparators),
                       f"{_SYMBOLS[type(op)]} -> {_SYMBOLS[swap]}")
    elif isinstance(node, ast.BoolOp):
        other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield ast.BoolOp(op=other, values=node.values), f"{_SYMBOLS[type(node.op)]} -> {_SYMBOLS[type(other)]}"
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield node.operand, "not x -> x"
    elif isinstance(node, ast.BinOp):
        binop_swap = _BINOP_SWAPS.get(type(node.op))
        if binop_swap is not None:
            yield (ast.BinOp(left=node.left, op=binop_swap(), right=node.right),
                   f"{_SYMBOLS[type(node.op)]} -> {_SYMBOLS[binop_swap]}")
    elif isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool):
            yield ast.Constant(not value), f"{value} -> {not value}"
        elif isinstance(value, (int, float)):
            yield ast.Constant(value + 1), f"{value!r} -> {value + 1!r}"


def mutants(source: str) -> list[Mutant]:
    """Every mutant of ``source``, in source order (deterministic: the same source gives the same list)."""
    tree = ast.parse(source)
    skip = _skipped(tree)
    starts = _offsets(source)
    out: list[Mutant] = []

    def span(node: ast.expr | ast.stmt) -> tuple[int, int]:
        end_line, end_col = node.end_lineno or node.lineno, node.end_col_offset or node.col_offset
        return starts[node.lineno - 1] + node.col_offset, starts[end_line - 1] + end_col

    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, (ast.expr, ast.stmt)):
            continue
        if isinstance(node, ast.expr):
            for mutated, what in _expression_edits(node):
                start, end = span(node)
                out.append(Mutant(node.lineno, start, end, f"({ast.unparse(mutated)})", what))
        elif isinstance(node, _DELETABLE):
            start, end = span(node)
            out.append(Mutant(node.lineno, start, end, "pass", "delete statement"))
            swap = _BINOP_SWAPS.get(type(node.op)) if isinstance(node, ast.AugAssign) else None
            if isinstance(node, ast.AugAssign) and swap is not None:
                changed = ast.unparse(ast.AugAssign(target=node.target, op=swap(), value=node.value))
                out.append(Mutant(node.lineno, start, end, changed,
                                  f"{_SYMBOLS[type(node.op)]}= -> {_SYMBOLS[swap]}="))
        elif isinstance(node, ast.Return) and node.value is not None and not (
                isinstance(node.value, ast.Constant) and node.value.value is None):
            start, end = span(node)
            out.append(Mutant(node.lineno, start, end, "return None", "return value -> None"))
    out.sort(key=lambda m: (m.start, m.end, m.description))
    return out


def apply(source: str, mutant: Mutant) -> str:
    return source[:mutant.start] + mutant.replacement + source[mutant.end:]


def source_line(source: str, mutant: Mutant) -> str:
    return source.splitlines()[mutant.line - 1].strip()


# ------------------------------------------------------------------------------------------------- the runner


#: directories of the tree that tests read besides the package and the tests (slurm/: the committed sbatch scripts
#: that tests/launch/test_slurm_render.py checks against the renderer's output)
TREE_DATA = ("slurm",)


def _copy_tree(root: Path, into: Path, package: str) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in (package, "tests", *TREE_DATA):
        if (root / name).exists():
            shutil.copytree(root / name, into / name, ignore=ignore)
    for name in ("pyproject.toml", "conftest.py"):
        if (root / name).exists():
            shutil.copy2(root / name, into / name)


#: third-party modules a worker imports once, before it forks a test run per mutant (each run still imports the
#: project, mutated, afresh), with every pytest plugin's module (hydra's plugin alone imports for ~1 s):
#: interpreter start and these imports were most of a small module's test run
PRELOAD = ("pytest", "hypothesis", "pydantic", "orjson", "httpx", "fastapi", "starlette", "anyio", "yaml", "jinja2",
           "tokenizers", "transformers", "numpy")


def _preload() -> None:
    import importlib
    import importlib.metadata

    plugins = [ep.module for ep in importlib.metadata.entry_points(group="pytest11")]
    for name in (*PRELOAD, *plugins):
        try:
            importlib.import_module(name)
        except Exception:  # not installed here, or not importable alone: the child imports what it needs
            pass


def serve(workdir: Path) -> None:
    """A worker: reads ``{"tests": [...], "timeout": seconds or null, "fresh": path}`` lines on stdin and answers
    each with a ``{"verdict": ..., "seconds": ...}`` line, running pytest in a forked child in ``workdir``.

    Bytecode is cached (compiling the project and the tests each run cost more than most runs), except the mutated
    module's: its cached bytecode is removed before each run, since a mutant of the same size written within the
    same second would otherwise pass the cache's mtime-and-size check and run the previous mutant."""
    import importlib.util
    import select
    import signal

    os.chdir(workdir)
    _preload()
    import gc

    import pytest

    gc.freeze()  # pytest collects five times at exit (unraisable-exception hook): not over the preloaded modules

    for line in sys.stdin:
        job = json.loads(line)
        if job.get("fresh"):
            Path(importlib.util.cache_from_source(job["fresh"])).unlink(missing_ok=True)
        began = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the child: a fresh import of the mutated tree, its output thrown away
            os.setpgid(0, 0)
            sys.path.insert(0, str(workdir))
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            code = 1
            try:
                code = int(pytest.main(["-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly", "-W",
                                         "ignore::pytest.PytestAssertRewriteWarning", *job["tests"]]))
            finally:
                os._exit(code)
        pidfd = os.pidfd_open(pid)
        ready, _, _ = select.select([pidfd], [], [], job["timeout"])
        if ready:
            verdict = "survived" if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0 else "killed"
        else:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            verdict = "timeout"
        os.close(pidfd)
        print(json.dumps({"verdict": verdict, "seconds": time.monotonic() - began}), flush=True)


class _Worker:
    """One worker process (:func:`serve`) and the copy of the tree it owns."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        env = {**os.environ, "PYTHONPATH": str(workdir), "POLAR_HYPOTHESIS": "mutate"}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", str(workdir)],
                                     cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, tests: Sequence[str], timeout: float | None, fresh: Path | None = None) -> tuple[str, float]:
        """Run ``tests``; ``fresh``: the mutated module, whose cached bytecode must not be used."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        job = {"tests": list(tests), "timeout": timeout, "fresh": str(fresh) if fresh else None}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise SystemExit(f"the mutation worker in {self.workdir} died")
        done = json.loads(answer)
        return done["verdict"], done["seconds"]

    def close(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        self.proc.wait()


def tests_by_line(workdir: Path, package: str, module: str, tests: Sequence[str]) -> dict[int, set[str]]:
    """Which tests run each line of the module (coverage with a context per test, one run of the unmutated tree):
    a mutant then runs only the tests that reach its line. ``""`` among a line's tests means the line runs
    outside any test (at import: constants, defaults, decorators), where every test may see it."""
    from coverage import CoverageData

    env = {**os.environ, "PYTHONPATH": str(workdir), "PYTHONDONTWRITEBYTECODE": "1", "POLAR_HYPOTHESIS": "mutate"}
    data_file = workdir.parent / f"{workdir.name}.coverage"
    config = workdir.parent / f"{workdir.name}.coveragerc"
    config.write_text(f"[run]\ndata_file = {data_file}\n")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                    f"--cov={package}", f"--cov-config={config}", "--cov-context=test", "--cov-report=", *tests],
                   cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    data = CoverageData(basename=str(data_file))
    data.read()
    target = str((workdir / package / module).resolve())
    by_line = data.contexts_by_lineno(target)
    return {line: {c.split("|", 1)[0] for c in contexts} for line, contexts in by_line.items()}


def _check_imports_from(workdir: Path, package: str) -> None:
    """A mutant written into the copy must be what the tests import (not an installed or editable package)."""
    env = {**os.environ, "PYTHONPATH": str(workdir), "PYTHONDONTWRITEBYTECODE": "1"}
    found = subprocess.run([sys.executable, "-c", f"import {package}; print({package}.__file__)"], cwd=workdir,
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    if not Path(found).resolve().is_relative_to(workdir.resolve()):
        raise SystemExit(f"the tests would import {package} from {found}, not from the mutated copy")


def run_module(module: str, tests: Sequence[str], *, root: Path = ROOT, package: str = "polar_gym", jobs: int = 2,
               limit: int | None = None, only: set[tuple[str, int, str, int]] | None = None,
               timeout_factor: float = 3.0, by_line: bool = True,
               equivalent: dict[tuple[str, str, str], str] | None = None,
               progress: Callable[[str], None] | None = None) -> ModuleResult:
    """Run every mutant of ``<root>/<package>/<module>`` against ``tests`` (paths relative to ``root``)."""
    equivalent = EQUIVALENT if equivalent is None else equivalent
    source = (root / package / module).read_text()
    keys = mutant_keys(source)
    todo = [m for m in mutants(source) if only is None or keys[m] in only][:limit]
    with tempfile.TemporaryDirectory(prefix="mutate-") as scratch:
        workers: Queue[_Worker] = Queue()
        started: list[_Worker] = []
        try:
            for i in range(max(1, jobs)):
                workdir = Path(scratch) / f"w{i}"
                _copy_tree(root, workdir, package)
                if i == 0:
                    _check_imports_from(workdir, package)
                started.append(_Worker(workdir))
                workers.put(started[-1])
            verdict, baseline = started[0].run(tests, None)
            if verdict != "survived":
                raise SystemExit(f"{module}: the tests fail before any mutation ({' '.join(tests)})")
            timeout = timeout_factor * baseline + 30
            reach = tests_by_line(started[0].workdir, package, module, tests) if by_line else None
            done: list[Outcome] = []
            listed = {t: i for i, t in enumerate(tests)}

            def tests_for(mutant: Mutant) -> list[str] | None:
                """The tests that reach the mutant's line (all of them for an import-time line), or None when
                none does: a line no test runs cannot be told apart from its mutant."""
                if reach is None:
                    return list(tests)
                reached = reach.get(mutant.line, set())
                if "" in reached:
                    return list(tests)
                # in the map's order: the fast pure tests a module lists first can fail before slower ones run
                return sorted(reached, key=lambda t: (listed.get(t.split("::", 1)[0], len(tests)), t)) or None

            def one(mutant: Mutant) -> Outcome:
                if (module, source_line(source, mutant), mutant.description) in equivalent:
                    outcome = Outcome(mutant, "equivalent", 0.0)
                elif (selected := tests_for(mutant)) is None:
                    outcome = Outcome(mutant, "survived", 0.0, "no test runs this line")
                else:
                    worker = workers.get()
                    target = worker.workdir / package / module
                    try:
                        target.write_text(apply(source, mutant))
                        outcome = Outcome(mutant, *worker.run(selected, timeout, target))
                    finally:
                        target.write_text(source)
                        workers.put(worker)
                done.append(outcome)
                if progress is not None and (len(done) % 25 == 0 or len(done) == len(todo)):
                    survived = sum(1 for o in done if o.verdict == "survived")
                    progress(f"  {module}: {len(done)}/{len(todo)} mutants run, {survived} survived")
                return outcome

            with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
                outcomes = list(pool.map(one, todo))
        finally:
            for worker in started:
                worker.close()
    return ModuleResult(module, tuple(tests), baseline, outcomes, source)


def equivalents_table() -> str:
    """``EQUIVALENT`` as a Markdown table (module, line, mutation, why), in module order."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| module | line | mutation | why it is equivalent |", "|---|---|---|---|"]
    for (module, line, mutation), why in sorted(EQUIVALENT.items()):
        rows.append(f"| `{module}` | `{cell(line)}` | {cell(mutation)} | {cell(why)} |")
    return "\n".join(rows)


def table(results: Sequence[ModuleResult]) -> str:
    lines = [f"{'module':48} {'mutants':>7} {'killed':>6} {'timeout':>7} {'survived':>8} {'equiv':>5} {'score':>6}"]
    for r in results:
        lines.append(f"{r.module:48} {len(r.outcomes):7} {r.count('killed'):6} {r.count('timeout'):7} "
                     f"{r.count('survived'):8} {r.count('equivalent'):5} {r.score:5.1f}%")
    for r in results:
        for o in r.outcomes:
            if o.verdict == "survived":
                why = f"  ({o.why})" if o.why else ""
                lines.append(f"  survived  polar_gym/{r.module}:{o.mutant.line}  {o.mutant.description}{why}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", action="append", help="a module under polar_gym/ (default: every mapped one)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel workers, each with its own copy of the tree")
    parser.add_argument("--limit", type=int, help="run only the first N mutants of each module (a smoke run)")
    parser.add_argument("--timeout-factor", type=float, default=3.0)
    parser.add_argument("--all-tests", action="store_true",
                        help="run every mapped test for every mutant (default: only the tests that reach its line)")
    parser.add_argument("--survivors-of", type=Path, metavar="JSON",
                        help="run only the mutants an earlier --json report lists as survivors or timeouts (after "
                             "new tests)")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--equivalents", action="store_true",
                        help="print the mutants named equivalent, with why, as a Markdown table")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # a worker (see serve)
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve)
        return 0
    if args.equivalents:
        print(equivalents_table())
        return 0
    modules = args.module or list(MODULE_TESTS)
    unknown = [m for m in modules if m not in MODULE_TESTS]
    if unknown:
        parser.error(f"no test map for {unknown}: add them to MODULE_TESTS")
    if args.list:
        for module in modules:
            source = (ROOT / "polar_gym" / module).read_text()
            for m in mutants(source)[:args.limit]:
                print(f"polar_gym/{module}:{m.line}  {m.description}")
        return 0
    earlier: dict[str, set[tuple[str, int, str, int]]] = {}
    if args.survivors_of is not None:
        for report in json.loads(args.survivors_of.read_text()):
            again = [*report["survivors"], *report.get("timeouts", [])]  # a hang on a loaded machine may not be one
            earlier[report["module"]] = {(k[0], k[1], k[2], k[3]) for k in (s["key"] for s in again)}
        modules = [m for m in modules if m in earlier]
    results = []
    for module in modules:
        results.append(run_module(module, MODULE_TESTS[module], jobs=args.jobs, limit=args.limit,
                                  only=earlier.get(module), by_line=not args.all_tests,
                                  timeout_factor=args.timeout_factor,
                                  progress=lambda line: print(line, file=sys.stderr, flush=True)))
        print(table(results[-1:]), flush=True)
    if len(results) > 1:
        print(table(results))
    if args.json:
        args.json.write_text(json.dumps([r.to_json() for r in results], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
