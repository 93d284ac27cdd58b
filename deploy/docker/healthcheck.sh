#!/bin/bash
# The images' health check: healthy when the service announced its port (the --port-file it
# writes once serving and removes when it stops) and that port accepts a connection; for the
# router (its port file names the HTTP port) GET /health must answer 200.
#   DI_PORT_FILE   the service's --port-file [/run/di/port]
#   DI_HEALTH_HOST the address the service listens on [this container's first address]
#   DI_HEALTH_HTTP 1 for an HTTP service (the router) [0]
set -u
port_file=${DI_PORT_FILE:-/run/di/port}
if [ "${1:-}" = --help ]; then sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
port=$(head -c 16 "$port_file" 2>/dev/null | tr -dc 0-9)
[ -n "$port" ] || { echo "di-healthcheck: $port_file holds no port: not serving" >&2; exit 1; }
host=${DI_HEALTH_HOST:-$(hostname -i 2>/dev/null | cut -d' ' -f1)}
host=${host:-127.0.0.1}
if ! exec 3<>"/dev/tcp/$host/$port"; then
  echo "di-healthcheck: nothing accepts connections on $host:$port" >&2
  exit 1
fi
if [ "${DI_HEALTH_HTTP:-0}" = 1 ]; then
  printf 'GET /health HTTP/1.0\r\nHost: %s\r\n\r\n' "$host" >&3
  status=$(timeout 5 head -n 1 <&3 | cut -d' ' -f2)
  exec 3<&-
  [ "$status" = 200 ] || { echo "di-healthcheck: GET /health answered ${status:-nothing}" >&2; exit 1; }
fi
exit 0
