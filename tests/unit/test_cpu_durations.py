"""tests/_cpu_time.py's --cpu-durations: a test that burns CPU, itself or in a child it reaps, ranks above one that
sleeps as long."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TESTS = '''
import subprocess, sys, time

def _spin(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

def test_sleeps():
    time.sleep(0.6)

def test_spins():
    _spin(0.3)

def test_spins_in_a_child():
    subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 0.6\\n"
                    "while time.process_time() < end: pass"], check=True)
'''


def test_the_tests_that_used_the_most_cpu_are_listed_first(tmp_path: Path) -> None:
    (tmp_path / "test_some.py").write_text(TESTS)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests._cpu_time",
                          "--cpu-durations", "2", "-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:]
    lines = out.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if "most CPU: 2 of 3 tests" in line)
    ranked = [line.split()[-1].split("::")[-1] for line in lines[head + 1:head + 3]]
    assert ranked == ["test_spins_in_a_child", "test_spins"], lines[head:head + 3]
    assert float(lines[head + 1].split("s cpu")[0]) >= 0.6
