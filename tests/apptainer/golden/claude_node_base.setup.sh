# polar_gym image setup (claude_code @anthropic-ai/claude-code@2.1.197 on docker://node:22-bookworm), rendered by polar_gym.apptainer.images; runs as root at build time
set -eu
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends git python3-pip python3
rm -rf /var/lib/apt/lists/*
# the harness CLI, pinned exactly (polar_gym.harness.install.PINS)
npm install -g --no-audit --no-fund --no-update-notifier @anthropic-ai/claude-code@2.1.197
claude --version || true
python3 -m pip install --no-cache-dir --break-system-packages pytest==8.3.4
mkdir -p /polar /workspace
