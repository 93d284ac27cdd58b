#!/usr/bin/env bash
# deploy/k8s/check.sh catches what it is there to catch: each case breaks one thing in a copy of
# deploy/ and expects exit 1 with the problem named; with stand-ins for di-prefill and di-decode
# whose --help lists their flags, the unbroken copy passes (exit 0), and without them it is
# exit 77 with "not built".
# usage: tests/deploy/test_check.sh BUILDDIR
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:?usage: test_check.sh BUILDDIR}" && pwd)
if [ ! -x "$build/kvstore/di-kvstore" ] || [ ! -x "$build/router/di-router" ]; then
  echo "test_check: di-kvstore and di-router are not built in $build"
  exit 77
fi
[ -d "$root/deploy/k8s/tools/node_modules" ] || { echo "test_check: run deploy/local/install-deps.sh"; exit 1; }
work=$(mktemp -d /tmp/deploy-check.XXXXXX)
trap 'rm -rf "$work"' EXIT

# a build dir with the real binaries and stand-ins for the services not built yet
mkdir -p "$work/build"/{kvstore,router,tools/mkmodel,prefill,decode}
for b in kvstore/di-kvstore kvstore/di-kvctl router/di-router tools/mkmodel/di-mkmodel; do
  ln -s "$build/$b" "$work/build/$b"
done
for s in prefill decode; do
  cat >"$work/build/$s/di-$s" <<HELP
#!/bin/sh
cat <<'TXT'
usage: di-$s [options]
  --listen HOST:PORT
  --port-file FILE
  --ready-fd FD
  --log-level LEVEL
  --drain DURATION
  --kvstore HOST:PORT
  --kvstore-token-file FILE
  --model DIR
  --config NAME
  --weights-seed N
  --backend NAME
  --threads N
  --token-file FILE
  --rank N
  --world N
  --help
TXT
HELP
  chmod +x "$work/build/$s/di-$s"
done

fresh() {
  rm -rf "$work/deploy"
  mkdir -p "$work/deploy/k8s"
  cp -r "$root/deploy/k8s/base" "$root/deploy/k8s/overlays" "$work/deploy/k8s/"
  cp -r "$root/deploy/grafana" "$root/deploy/docker" "$work/deploy/"
}
run() { # build dir; prints the output, returns the exit status
  local rc=0
  "$root/deploy/k8s/check.sh" --build "$1" --k8s "$work/deploy/k8s" --docker "$work/deploy/docker" \
    >"$work/out" 2>&1 || rc=$?
  return $rc
}
fails=0
expect() { # name, wanted exit status, wanted text
  local rc=0
  run "$work/build" || rc=$?
  if [ "$rc" = "$2" ] && grep -qF -- "$3" "$work/out"; then
    echo "ok: $1"
  else
    echo "FAIL: $1: exit $rc (want $2), want \"$3\" in:"
    sed 's/^/    /' "$work/out"
    fails=$((fails + 1))
  fi
}

fresh
expect "the manifests as they are pass" 0 "every overlay renders and validates"

fresh
sed -i 's|            - --durability|            - --no-such-flag\n            - --durability|' "$work/deploy/k8s/base/kvstore.yaml"
expect "a flag the binary lacks" 1 "di-kvstore has no flag --no-such-flag"

fresh
sed -i 's|          envFrom:|          envFrom:\n            - configMapRef:\n                name: engine-config|' "$work/deploy/k8s/base/kvstore.yaml"
expect "a variable the binary does not read" 1 "di-kvstore does not read BACKEND"

fresh
sed -i 's|containerPort: 9470|containerPort: "grpc"|' "$work/deploy/k8s/base/kvstore.yaml"
expect "a value of the wrong type" 1 "containerPort must be integer"

fresh
# shellcheck disable=SC2016 # $(VAR) is Kubernetes' syntax, not the shell's
sed -i 's|            - \$(TTL_BLOCK)|            - $(TTL_BLOK)|' "$work/deploy/k8s/base/kvstore.yaml"
expect "an undefined \$(VAR)" 1 "\$(TTL_BLOK) in its arguments is not defined"

fresh
sed -i 's|PREFILL_WORLD=2|PREFILL_WORLD=3|' "$work/deploy/k8s/overlays/cpu-small/kustomization.yaml"
expect "a world size that is not the replica count" 1 "but engine-config PREFILL_WORLD is 3"

fresh
sed -i 's|            - prefill-3.prefill:9480|            - prefill-7.prefill:9480|' "$work/deploy/k8s/overlays/gpu-rdma/router.yaml"
expect "a router rank list that is not the pods" 1 "the router's --prefill list is"

fresh
sed -i 's|terminationGracePeriodSeconds: 315|terminationGracePeriodSeconds: 100|' "$work/deploy/k8s/base/decode.yaml"
expect "a grace period shorter than the drain" 1 "terminationGracePeriodSeconds 100 is shorter than --drain (300 s)"

fresh
sed -i 's|port: grpc$|port: grcp|' "$work/deploy/k8s/base/kvstore.yaml"
expect "a probe on a port not declared" 1 "livenessProbe names port grcp"

fresh
sed -i 's|^  - path: small.yaml|  - path: small.yaml\n  - path: missing.yaml|' "$work/deploy/k8s/overlays/cpu-small/kustomization.yaml"
expect "a patch file that is not there" 1 "cpu-small: does not render"

fresh
sed -i '/^USER /d' "$work/deploy/docker/Dockerfile"
expect "a runtime image running as root" 1 "does not end as a non-root USER"

fresh
sed -i 's|^HEALTHCHECK|HEALTHCHEK|' "$work/deploy/docker/Dockerfile.cuda"
expect "a Dockerfile that does not lint" 1 "Unknown instruction: HEALTHCHEK"

fresh
sed -i 's|^COPY deploy/local/install-deps.sh |COPY deploy/local/install-dep.sh |' "$work/deploy/docker/Dockerfile"
expect "a COPY of a file that is not there" 1 "COPY deploy/local/install-dep.sh: not in the build context"

fresh
sed -i 's|terminationGracePeriodSeconds: 75|terminationGracePeriodSecond: 75|' "$work/deploy/k8s/base/router.yaml"
expect "a misspelt field" 1 "spec.template.spec.terminationGracePeriodSecond: unknown field"

fresh # last: it removes a stand-in
rm "$work/build/decode/di-decode"
expect "a binary not built is exit 77, named" 77 "not built: di-decode"

[ "$fails" = 0 ] || { echo "test_check: $fails case(s) failed"; exit 1; }
echo "test_check: every case passed"
