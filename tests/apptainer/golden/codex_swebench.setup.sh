# polar_gym image setup (codex @openai/codex@0.169.0 on docker://swebench/sweb.eval.x86_64.astropy__astropy-12907:latest), rendered by polar_gym.apptainer.images; runs as root at build time
set -eu
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends ca-certificates curl xz-utils git
rm -rf /var/lib/apt/lists/*
# Node.js 22.12.0 from the official tarball (the base image has none)
case "$(uname -m)" in x86_64) node_arch=x64 ;; aarch64) node_arch=arm64 ;; *) echo "unsupported arch $(uname -m)" >&2; exit 1 ;; esac
curl -fsSL "https://nodejs.org/dist/v22.12.0/node-v22.12.0-linux-${node_arch}.tar.xz" -o /tmp/node.tar.xz
mkdir -p /opt/node
tar -xJf /tmp/node.tar.xz -C /opt/node --strip-components=1
rm /tmp/node.tar.xz
export PATH=/opt/node/bin:$PATH
# the harness CLI, pinned exactly (polar_gym.harness.install.PINS)
npm install -g --no-audit --no-fund --no-update-notifier @openai/codex@0.169.0
codex --version || true
git -C /testbed status
mkdir -p /polar /testbed
