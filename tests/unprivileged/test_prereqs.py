"""scripts/prereqs.sh, the table a user's set-up prints: on a PATH without bubblewrap, gcc or node it says what each
missing part disables, asks an admin for what set-up cannot replace, and lists what PyPI replaces as optional."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_table_names_what_is_missing_and_what_to_ask_for(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "id", "grep"):  # nothing else: no bwrap, podman, gcc, node, git, python, chromium
        os.symlink(f"/usr/bin/{tool}", bin_dir / tool)
    proc = subprocess.run(["/usr/bin/bash", str(ROOT / "scripts" / "prereqs.sh")], capture_output=True, text=True,
                          timeout=60, env={"PATH": str(bin_dir), "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()[2:] if line.startswith("  ") and
            not line.startswith("   ")}
    assert "missing" in rows["bubblewrap"] and "runtime=local" in rows["bubblewrap"]
    assert "replaced" in rows["node"] and "Node.js from its PyPI wheel" in rows["node"]
    assert "replaced" in rows["gcc"] and "zig" in rows["gcc"]
    ask = proc.stdout.split("ask an admin for:\n", 1)[1].splitlines()[0].split()
    assert ask[:2] == ["apt-get", "install"] and {"bubblewrap", "podman", "git", "chromium"} <= set(ask)
    assert not {"gcc", "nodejs"} & set(ask)  # set-up replaces those: optional, not asked for
    assert "optional (set-up replaces them from PyPI): apt-get install gcc libc6-dev nodejs npm" in proc.stdout
