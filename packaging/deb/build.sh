#!/usr/bin/env bash
# Builds libnginx-mod-http-loom_<version>-1_<arch>.deb, shaped like Debian's
# own libnginx-mod-* packages. Run by `make deb`:
#   packaging/deb/build.sh <version> <output directory>
set -euo pipefail
VERSION="$1"
OUT="$2"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
HERE="$ROOT/packaging/deb"
ARCH="$(dpkg --print-architecture)"
NAME=libnginx-mod-http-loom
WORK="$OUT/deb"
# the maintainer: DEB_MAINTAINER, or the author of the last commit
MAINTAINER="${DEB_MAINTAINER:-$(git -C "$ROOT" log -1 --format='%an <%ae>')}"
STAGE="$WORK/root"

rm -rf "$WORK"
mkdir -p "$STAGE/DEBIAN"
make -s -C "$ROOT" install DESTDIR="$STAGE" PREFIX=/usr \
    DOC_DIR=/usr/share/doc/$NAME
so="$STAGE/usr/lib/nginx/modules/ngx_loom_module.so"
strip --strip-unneeded --remove-section=.comment --remove-section=.note "$so"
install -D -m 0644 "$HERE/mod-http-loom.conf" \
    "$STAGE/usr/share/nginx/modules-available/mod-http-loom.conf"
install -m 0644 "$HERE/copyright" "$STAGE/usr/share/doc/$NAME/copyright"
# Debian's documentation rules: no separate license file, changelogs gzipped
rm "$STAGE/usr/share/doc/$NAME/LICENSE"
gzip -9n "$STAGE/usr/share/doc/$NAME/CHANGELOG.md"
mv "$STAGE/usr/share/doc/$NAME/CHANGELOG.md.gz" \
   "$STAGE/usr/share/doc/$NAME/changelog.gz"
{
    echo "lua-resty-loom ($VERSION-1) unstable; urgency=medium"
    echo
    echo "  * Release $VERSION; see changelog.gz."
    echo
    echo " -- $MAINTAINER  $(date -R -d @"${SOURCE_DATE_EPOCH:-$(git -C "$ROOT" log -1 --format=%ct)}")"
} | gzip -9n > "$STAGE/usr/share/doc/$NAME/changelog.Debian.gz"
install -m 0755 "$HERE/postinst" "$HERE/postrm" "$STAGE/DEBIAN/"

# the exact nginx ABI this module was built for, as libnginx-mod-* do
abi="$(dpkg-query -W -f='${Provides}' nginx | tr ',' '\n' \
       | grep -o 'nginx-abi-[^ ]*')"
# the shared libraries the module links (dpkg-shlibdeps wants debian/control)
mkdir -p "$WORK/src/debian"
printf 'Source: lua-resty-loom\n\nPackage: %s\nArchitecture: any\n' "$NAME" \
    > "$WORK/src/debian/control"
shlibs="$(cd "$WORK/src" && dpkg-shlibdeps -O "$so" \
          | sed -n 's/^shlibs:Depends=//p')"
size="$(du -k -s --exclude=DEBIAN "$STAGE" | cut -f1)"
sed -e "s/@VERSION@/$VERSION/" -e "s/@ARCH@/$ARCH/" -e "s/@SIZE@/$size/" \
    -e "s/@NGINX_ABI@/$abi/" -e "s/@SHLIBS@/$shlibs/" \
    -e "s|@MAINTAINER@|$MAINTAINER|" \
    "$HERE/control.in" > "$STAGE/DEBIAN/control"
(cd "$STAGE" && find usr -type f -printf '%P\n' | sort \
    | sed 's|^|usr/|' | xargs md5sum) > "$STAGE/DEBIAN/md5sums"
chmod 0644 "$STAGE/DEBIAN/md5sums"
find "$STAGE" -type d -exec chmod 0755 {} +

deb="$OUT/${NAME}_${VERSION}-1_${ARCH}.deb"
dpkg-deb --root-owner-group -Zxz --build "$STAGE" "$deb" >/dev/null
echo "built $deb"
