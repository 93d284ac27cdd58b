#!/usr/bin/env bash
# Renders every overlay of deploy/k8s into BUILD/k8s/<overlay>.yaml, validates each object
# offline against the Kubernetes OpenAPI schemas, checks every flag and environment variable
# the manifests pass against the binary's --help (from BUILD), and lints deploy/docker. Where
# kubectl is installed, also checks that `kubectl kustomize` renders every overlay the same.
# usage: deploy/k8s/check.sh [--build DIR] [--k8s DIR] [--docker DIR]
# Exit 0: all good; 1: a problem (each printed as "problem: ..."); 2: bad usage;
# 77: no problem, but a binary is not built, so its flags were not checked ("not built: ...").
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=$root/build
k8s=$here
docker=$root/deploy/docker
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=${2:?--build needs a directory}; shift ;;
    --k8s) k8s=${2:?--k8s needs a directory}; shift ;;
    --docker) docker=${2:?--docker needs a directory}; shift ;;
    -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
command -v node >/dev/null || { echo "check.sh: node is not installed: run deploy/local/install-deps.sh" >&2; exit 1; }
[ -d "$here/tools/node_modules/kubernetes-models" ] ||
  { echo "check.sh: $here/tools/node_modules is missing: run deploy/local/install-deps.sh" >&2; exit 1; }

rc=0
node "$here/tools/check.js" --k8s "$k8s" --docker "$docker" --context "$root" --build "$build" --out "$build/k8s" || rc=$?
if [ "$rc" != 0 ] && [ "$rc" != 77 ]; then exit 1; fi

if command -v kubectl >/dev/null 2>&1; then
  for ov in "$k8s"/overlays/*/; do
    name=$(basename "$ov")
    if ! kubectl kustomize "$ov" >"$build/k8s/$name.kubectl.yaml" 2>"$build/k8s/$name.kubectl.err"; then
      echo "problem: $name: kubectl kustomize fails: $(head -n 1 "$build/k8s/$name.kubectl.err")"
      exit 1
    fi
    if ! node "$here/tools/cmp.js" "$build/k8s/$name.yaml" "$build/k8s/$name.kubectl.yaml"; then
      echo "problem: $name: kubectl kustomize renders it differently (above)"
      exit 1
    fi
    echo "kustomize: $name: kubectl kustomize renders the same objects"
  done
else
  echo "kustomize: kubectl is not installed; rendered with deploy/k8s/tools/render.js only"
fi
exit "$rc"
