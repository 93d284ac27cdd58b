# Sourced by the cluster tests (test_cluster.sh, test_cluster_pd.sh, test_skew.sh) after they set
# $cluster: a scratch folder $work, the cluster's $state (set by the test once it is up), the
# cleanup on exit (a test's own cleanup_extra first, when it defines one; then the cluster down
# and $work removed) and the ok/bad counters.
# Usage: . lib.sh NAME   (NAME names the scratch folder)
work=$(mktemp -d "/tmp/test-${1:?lib.sh: a test name}.XXXXXX")
state=
cleanup() {
  if declare -F cleanup_extra >/dev/null; then cleanup_extra; fi
  [ -z "$state" ] || [ ! -d "$state" ] || "$cluster" down "$state" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

fails=0
ok() { echo "ok: $*"; }
bad() { echo "FAIL: $*"; fails=$((fails + 1)); }
