#!/usr/bin/env bash
# Installs every Debian package moat needs to build and test (run as root on Debian 12).
# Torch is not needed to build or test; tools/ (reference model, trainer) need python3-torch:
#   tools/setup-debian.sh --tools
set -euo pipefail
packages=(build-essential cmake pkg-config git
  libfmt-dev nlohmann-json3-dev libcli11-dev libonig-dev libcpp-httplib-dev
  libgtest-dev libgmock-dev libbenchmark-dev libcairo2-dev
  libopenmpi-dev openmpi-bin)
if [[ "${1:-}" == "--tools" ]]; then
  packages+=(python3-torch python3-numpy python3-regex python3-jinja2 fortunes-min fortunes)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The end-to-end test with the official OpenAI client library (tests/server/openai_client) needs
# Node.js and the `openai` npm package from the npm registry. Without them that one test skips
# (ctest reports it), so a machine without the registry still builds and tests everything else.
root="$(cd "$(dirname "$0")/.." && pwd)"
if [[ -f "$root/tests/server/openai_client/package-lock.json" ]]; then
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nodejs npm || true
  fi
  if command -v npm >/dev/null && [[ ! -d "$root/tests/server/openai_client/node_modules/openai" ]]; then
    npm ci --silent --no-audit --no-fund --prefix "$root/tests/server/openai_client" ||
      echo "setup-debian.sh: npm ci failed (no registry?): the OpenAI client library test will skip" >&2
  fi
fi
