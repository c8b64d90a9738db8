#!/usr/bin/env bash
# Starts the example gateway in the foreground on 127.0.0.1:8080; Ctrl-C
# stops it. The prefix (logs, sockets, temp files) is build/gateway.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PREFIX="${LOOM_GATEWAY_PREFIX:-$ROOT/build/gateway}"
MODULES="${LOOM_NGINX_MODULES:-/usr/share/nginx/modules}"
NGINX="${LOOM_NGINX:-/usr/sbin/nginx}"
USER_LINE=""
if [ "$(id -u)" = 0 ]; then USER_LINE="user root;"; fi

mkdir -p "$PREFIX/conf" "$PREFIX/logs"
sed -e "s#@ROOT@#$ROOT#g" -e "s#@PREFIX@#$PREFIX#g" \
    -e "s#@MODULES@#$MODULES#g" -e "s#@USER@#$USER_LINE#g" \
    "$ROOT/examples/gateway/nginx.conf" > "$PREFIX/conf/nginx.conf"

echo "resty-loom gateway on http://127.0.0.1:8080 (Ctrl-C stops it)"
exec "$NGINX" -p "$PREFIX" -c "$PREFIX/conf/nginx.conf" "$@"
