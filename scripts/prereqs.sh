#!/usr/bin/env bash
# Which system parts polar_gym uses are on this machine, for a user without root: what is there, what a missing one
# disables (or what replaces it), and the line to ask an admin for. Changes nothing; always exits 0.
#   bash scripts/prereqs.sh        (scripts/setup.sh runs it when it is not root)
set -uo pipefail
PY=${POLAR_PYTHON:-python3.11}
me=$(id -un 2>/dev/null || id -u)
rows=()
apt=()
optional=()
other=()
row() { rows+=("$(printf '%-26s %-8s %s' "$1" "$2" "$3")"); }

# bubblewrap, and unprivileged user namespaces (it needs them when it is not setuid)
if ! command -v bwrap >/dev/null; then
  row "bubblewrap" missing "runtime=local (the main job's sandbox, the harness and conformance tests)"; apt+=(bubblewrap)
elif ! bwrap --unshare-user --unshare-net --ro-bind / / true >/dev/null 2>&1; then
  row "user namespaces" missing "runtime=local: bwrap cannot create an unprivileged user namespace"
  other+=("sysctl -w kernel.unprivileged_userns_clone=1 user.max_user_namespaces=15000 (and, under AppArmor, kernel.apparmor_restrict_unprivileged_userns=0)")
else
  row "bubblewrap + userns" ok "runtime=local"
fi
# rootless podman: podman, newuidmap/newgidmap and a subordinate id range for this user
if ! command -v podman >/dev/null; then
  row "podman (rootless)" missing "runtime=docker through podman"; apt+=(podman runc)
elif ! command -v newuidmap >/dev/null; then
  row "newuidmap (uidmap)" missing "runtime=docker through rootless podman"; apt+=(uidmap)
elif ! grep -q "^$me:" /etc/subuid 2>/dev/null && ! grep -q "^$(id -u):" /etc/subuid 2>/dev/null; then
  row "subuid range" missing "runtime=docker through rootless podman (no /etc/subuid entry for $me)"
  other+=("usermod --add-subuids 100000-165535 --add-subgids 100000-165535 $me")
else
  row "podman (rootless)" ok "runtime=docker"
  # the harness image's Debian base, made without root (polar_gym/apptainer/rootless.py)
  if command -v mmdebstrap >/dev/null; then
    row "mmdebstrap" ok "the harness image's base, built rootless"
  elif command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null; then
    row "mmdebstrap" replaced "set-up fetches it with apt-get download (no root) for the harness image's base"
  else
    row "mmdebstrap" missing "the harness image (runtime=docker's default image) cannot be built rootless"
    apt+=(mmdebstrap)
  fi
fi
if command -v apptainer >/dev/null; then
  row "apptainer" ok "runtime=apptainer"
else
  row "apptainer" missing "runtime=apptainer (not in Debian 12's archive: the site's module or package)"
fi
if command -v gcc >/dev/null && compgen -G '/usr/lib/*-linux-gnu/libc.a' >/dev/null; then
  row "gcc + libc6-dev" ok "the static sandbox helper"
else
  row "gcc + libc6-dev" replaced "the sandbox helper is built with zig from PyPI instead"; optional+=(gcc libc6-dev)
fi
if command -v node >/dev/null && command -v npm >/dev/null; then
  row "node + npm" ok "the harness CLIs ($(node --version 2>/dev/null))"
else
  row "node + npm" replaced "the harness CLIs run with Node.js from its PyPI wheel instead"; optional+=(nodejs npm)
fi
if command -v git >/dev/null; then
  row "git" ok "git inside sandboxes (harnesses, SWE-style tasks)"
else
  row "git" missing "git inside the local sandbox (harnesses that diff, SWE-style tasks)"; apt+=(git)
fi
if "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1; then
  row "$PY + venv" ok "everything (required)"
else
  row "$PY + venv" missing "EVERYTHING: set-up cannot make its venv"; apt+=(python3.11 python3.11-venv)
fi
if command -v python3.13 >/dev/null || [ -x "$HOME/.pyenv/versions/3.13.0/bin/python3.13" ]; then
  row "python3.13" ok "NeMo Gym (setup.sh --engine)"
else
  row "python3.13" missing "NeMo Gym (setup.sh --engine skips it; not in Debian 12's archive: pyenv or a module)"
fi
if command -v chromium >/dev/null; then
  row "chromium" ok "the browser tests of report.html and the trace viewer"
else
  row "chromium" missing "the browser tests of report.html and the trace viewer (they skip)"; apt+=(chromium)
fi
if compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
  row "postgresql" ok "several rollout server workers on one store (and their tests)"
else
  row "postgresql" missing "several rollout server workers (one worker on SQLite still runs; their tests skip)"
  apt+=(postgresql-15)
fi

if [ "$(id -u)" -eq 0 ]; then
  printf '\033[1m[setup]\033[0m running as root: setup.sh installs what is missing with apt-get; the system parts polar_gym uses:\n'
else
  printf '\033[1m[setup]\033[0m running as %s (not root): no apt-get; the system parts polar_gym uses:\n' "$me"
fi
printf '  %-26s %-8s %s\n' "part" "status" "what it gives / what is disabled without it"
for r in "${rows[@]}"; do printf '  %s\n' "$r"; done
if [ ${#apt[@]} -gt 0 ] || [ ${#other[@]} -gt 0 ]; then
  printf '  ask an admin for:\n'
  [ ${#apt[@]} -gt 0 ] && printf '    apt-get install %s\n' "${apt[*]}"
  for line in "${other[@]}"; do printf '    %s\n' "$line"; done
fi
if [ ${#optional[@]} -gt 0 ]; then
  printf '  optional (set-up replaces them from PyPI): apt-get install %s\n' "${optional[*]}"
fi
exit 0
