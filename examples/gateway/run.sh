#!/usr/bin/env bash
# Starts the example gateway in the foreground on 127.0.0.1:8080; Ctrl-C
# stops it. The prefix (logs, sockets, temp files) is build/gateway.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PREFIX="${LOOM_GATEWAY_PREFIX:-$ROOT/build/gateway}"
MODULES="${LOOM_NGINX_MODULES:-/usr/share/nginx/modules}"
NGINX="${LOOM_NGINX:-/usr/sbin/nginx}"
LISTEN="${LOOM_GATEWAY_LISTEN:-127.0.0.1:8080}"
USER_LINE=""
if [ "$(id -u)" = 0 ]; then USER_LINE="user root;"; fi

render() {
    sed -e "s#@ROOT@#$ROOT#g" -e "s#@PREFIX@#$PREFIX#g" \
        -e "s#@MODULES@#$MODULES#g" -e "s#@USER@#$USER_LINE#g" \
        -e "s#@LISTEN@#$LISTEN#g" "$1" > "$2"
}

rm -rf "$PREFIX/conf"
mkdir -p "$PREFIX/conf/conf.d" "$PREFIX/logs"
render "$ROOT/examples/gateway/nginx.conf" "$PREFIX/conf/nginx.conf"
for f in "$ROOT"/examples/gateway/conf.d/*.conf; do
    [ -e "$f" ] || continue
    render "$f" "$PREFIX/conf/conf.d/$(basename "$f")"
done
if [ -n "${LOOM_GATEWAY_RENDER_ONLY:-}" ]; then exit 0; fi

echo "resty-loom gateway on http://$LISTEN (Ctrl-C stops it)"
exec "$NGINX" -p "$PREFIX" -c "$PREFIX/conf/nginx.conf" "$@"
