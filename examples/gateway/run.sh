#!/usr/bin/env bash
# Starts the example gateway in the foreground on 127.0.0.1:8080; Ctrl-C
# stops it. The prefix (logs, sockets, temp files) is build/gateway.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PREFIX="${LOOM_GATEWAY_PREFIX:-$ROOT/build/gateway}"
MODULES="${LOOM_NGINX_MODULES:-/usr/share/nginx/modules}"
NGINX="${LOOM_NGINX:-/usr/sbin/nginx}"
LISTEN="${LOOM_GATEWAY_LISTEN:-127.0.0.1:8080}"
# Started as root, nginx runs its workers as nobody (its default), or as
# LOOM_GATEWAY_USER; started as another user, they run as that user.
USER_LINE=""
if [ -n "${LOOM_GATEWAY_USER:-}" ]; then USER_LINE="user $LOOM_GATEWAY_USER;"; fi

render() {
    sed -e "s#@ROOT@#$ROOT#g" -e "s#@PREFIX@#$PREFIX#g" \
        -e "s#@MODULES@#$MODULES#g" -e "s#@USER@#$USER_LINE#g" \
        -e "s#@LISTEN@#$LISTEN#g" "$1" > "$2"
}

rm -rf "$PREFIX/conf"
mkdir -p "$PREFIX/conf/conf.d" "$PREFIX/logs"
# the bus socket's directory: `nginx -t` binds the socket before Lua runs
mkdir -p -m 0700 "$PREFIX/sock"
# the configuration the gateway keeps across reloads, and the publisher's
# spool: its workers write them
mkdir -p "$PREFIX/state" "$PREFIX/spool"
if [ "$(id -u)" = 0 ]; then
    read -r WORKER WORKER_GROUP <<< "${LOOM_GATEWAY_USER:-nobody}"
    chown "$WORKER" "$PREFIX/state" "$PREFIX/spool"
fi
render "$ROOT/examples/gateway/nginx.conf" "$PREFIX/conf/nginx.conf"
for f in "$ROOT"/examples/gateway/conf.d/*.conf; do
    [ -e "$f" ] || continue
    render "$f" "$PREFIX/conf/conf.d/$(basename "$f")"
done
if [ -n "${LOOM_GATEWAY_RENDER_ONLY:-}" ]; then exit 0; fi

# a packaged nginx (or anything else) may already hold the address
if (exec 3<>"/dev/tcp/${LISTEN%:*}/${LISTEN##*:}") 2>/dev/null; then
    echo "$LISTEN is already in use (a running nginx?); choose another" \
         "address: LOOM_GATEWAY_LISTEN=127.0.0.1:8081 make run" >&2
    exit 1
fi

# The workers load Lua modules from the checkout and write under the
# prefix: a checkout in a directory private to root (/root) would give
# a gateway that starts and then fails on every worker.
if [ "$(id -u)" = 0 ] && ! setpriv --reuid="$WORKER" \
        --regid="${WORKER_GROUP:-$(id -gn "$WORKER")}" --clear-groups \
        test -r "$ROOT/lib/resty/loom/events.lua" -a -w "$PREFIX/state" \
        -a -w "$PREFIX/spool"
then
    echo "the workers run as $WORKER and cannot read $ROOT or write" \
         "$PREFIX (a private parent directory?); put the checkout" \
         "where $WORKER can read it (e.g. under /opt), or choose" \
         "their user: LOOM_GATEWAY_USER=<user> make run" >&2
    exit 1
fi

echo "resty-loom gateway on http://$LISTEN (Ctrl-C stops it)"
exec "$NGINX" -p "$PREFIX" -c "$PREFIX/conf/nginx.conf" \
    -e "$PREFIX/logs/error.log" "$@"
