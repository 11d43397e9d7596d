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
