#!/usr/bin/env bash
# Build dist/activator_VERSION_ARCH.deb, a Debian package of the one-file executable.
#
# Usage: packaging/build-deb.sh [--build] [--version VERSION] [--output DIR] [EXECUTABLE]
#   EXECUTABLE     the executable to package (default dist/activator)
#   --build        run packaging/build.sh first, which makes dist/activator
#   --version V    the package's version (default: the executable's own, Debian
#                  revision 1: 0.1.0-1 for "activator 0.1.0")
#   --output DIR   where the .deb goes (default dist/)
# The last line printed is the path of the package.
#
# The package holds:
#   /usr/bin/activator                         the executable, as given
#   /lib/systemd/system/activator.service      systemd/activator.service, run from /usr/bin
#   /etc/activator/activator.yaml              config/example.yaml, a conffile: dpkg never
#                                              overwrites an operator's edits
#   /usr/share/man/man1/activator.1.gz, /usr/share/doc/activator/{copyright,changelog.Debian.gz}
# and the maintainer scripts of packaging/debian/ (what they do is in their headers).
# Depends: what dpkg-shlibdeps finds for the bootloader, with glibc raised to this
# machine's: the libraries inside the executable need the glibc of the machine that
# built it, so build the package where the executable was built (--build does).
#
# Needs dpkg-deb and dpkg-shlibdeps (package dpkg-dev), gzip and git. Reproducible like
# build.sh: every date is the last commit's (SOURCE_DATE_EPOCH), files are sorted and
# owned by root, so the same executable and tree give the same bytes.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEBIAN_DIR=$ROOT/packaging/debian
UNIT_DIR=lib/systemd/system

usage() {
  sed -n '4,10s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
}
die() {
  printf 'build-deb.sh: %s\n' "$*" >&2
  exit 1
}

build=0
version=
output=$ROOT/dist
executable=
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=1 ;;
    --version)
      [ $# -ge 2 ] || { usage >&2; exit 2; }
      version=$2
      shift
      ;;
    --output)
      [ $# -ge 2 ] || { usage >&2; exit 2; }
      output=$2
      shift
      ;;
    -h | --help) usage; exit 0 ;;
    -*) usage >&2; exit 2 ;;
    *)
      [ -z "$executable" ] || { usage >&2; exit 2; }
      executable=$1
      ;;
  esac
  shift
done
executable=${executable:-$ROOT/dist/activator}

if [ $build = 1 ]; then
  bash "$ROOT/packaging/build.sh"
fi
if [ ! -f "$executable" ] || [ ! -x "$executable" ]; then
  die "no executable at $executable (packaging/build.sh makes one; or pass --build)"
fi
for tool in dpkg-deb dpkg-shlibdeps gzip; do
  command -v "$tool" >/dev/null || die "$tool is missing (apt-get install dpkg-dev)"
done

# The executable says which version it is; the tree it is packaged with must agree, or
# the unit and the example config could belong to another release.
reported=$("$executable" --version) || die "$executable --version failed"
upstream_version=${reported#activator }
tree_version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml")
if [ "$upstream_version" != "$tree_version" ]; then
  die "$executable is version $upstream_version but pyproject.toml says $tree_version: rebuild it (--build)"
fi
version=${version:-$upstream_version-1}
arch=$(dpkg --print-architecture)

SOURCE_DATE_EPOCH=$(git -C "$ROOT" log -1 --format=%ct 2>/dev/null || true)
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-315532800}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# dpkg-shlibdeps expects the package's tree at debian/PACKAGE under its working directory.
pkg=$work/debian/activator
umask 022

install -D -m 0755 "$executable" "$pkg/usr/bin/activator"

# The unit runs the packaged executable, names the packaged man page, and its first
# comment says where this copy lives.
install -d -m 0755 "$pkg/$UNIT_DIR"
sed -e 's|/usr/local/bin/activator|/usr/bin/activator|g' \
  -e "s|^# Installed by .*|# Installed by the activator Debian package as /$UNIT_DIR/activator.service.|" \
  -e '/^Description=/a Documentation=man:activator(1)' \
  "$ROOT/systemd/activator.service" >"$pkg/$UNIT_DIR/activator.service"
grep -q '^ExecStart=/usr/bin/activator ' "$pkg/$UNIT_DIR/activator.service" ||
  die "systemd/activator.service: no ExecStart=/usr/local/bin/activator line to point at /usr/bin/activator"

install -D -m 0644 "$ROOT/config/example.yaml" "$pkg/etc/activator/activator.yaml"

install -d -m 0755 "$pkg/usr/share/man/man1" "$pkg/usr/share/doc/activator"
gzip -9n <"$DEBIAN_DIR/activator.1" >"$pkg/usr/share/man/man1/activator.1.gz"
install -m 0644 "$DEBIAN_DIR/copyright" "$pkg/usr/share/doc/activator/copyright"
install -D -m 0644 "$DEBIAN_DIR/lintian-overrides" "$pkg/usr/share/lintian/overrides/activator"

# The control template's Maintainer signs the changelog entry.
maintainer=$(sed -n 's/^Maintainer: //p' "$DEBIAN_DIR/control.in")
{
  printf 'activator (%s) unstable; urgency=medium\n\n' "$version"
  printf '  * Package of the one-file executable of activator %s.\n\n' "$upstream_version"
  printf ' -- %s  %s\n' "$maintainer" "$(date -u -R -d "@$SOURCE_DATE_EPOCH")"
} | gzip -9n >"$pkg/usr/share/doc/activator/changelog.Debian.gz"

install -d -m 0755 "$pkg/DEBIAN"
install -m 0644 "$DEBIAN_DIR/conffiles" "$pkg/DEBIAN/conffiles"
for script in postinst prerm postrm; do
  sed -e "/^#HELPERS#\$/{r $DEBIAN_DIR/maintscript-helpers.sh" -e 'd}' \
    "$DEBIAN_DIR/$script" >"$pkg/DEBIAN/$script"
  chmod 0755 "$pkg/DEBIAN/$script"
done

# dpkg-shlibdeps reads the package list from debian/control. Its warnings 1 (a symbol
# not found) only: the "useless dependency" ones are about how PyInstaller links its
# bootloader, which this package cannot change.
printf 'Source: activator\n\nPackage: activator\nArchitecture: any\n' >"$work/debian/control"
shlibs=$(cd "$work" && dpkg-shlibdeps -O --warnings=1 -xlibc6 debian/activator/usr/bin/activator)
other_depends=${shlibs#shlibs:Depends=}
glibc=$(dpkg-query -W -f='${Version}' libc6)
depends="libc6 (>= ${glibc%%-*})${other_depends:+, $other_depends}"
installed_size=$(du -s -k --apparent-size --exclude=DEBIAN "$pkg" | cut -f1)
sed -e '/^#/d' \
  -e "s|@VERSION@|$version|" -e "s|@ARCH@|$arch|" \
  -e "s|@DEPENDS@|$depends|" -e "s|@INSTALLED_SIZE@|$installed_size|" \
  "$DEBIAN_DIR/control.in" >"$pkg/DEBIAN/control"

# md5sums of every file but the conffiles (dpkg keeps their sums itself), for debsums
# and dpkg --verify.
(cd "$pkg" && find . -type f ! -path './DEBIAN/*' -printf '%P\n' |
  grep -v -x -F -f <(sed 's|^/||' "$DEBIAN_DIR/conffiles") | LC_ALL=C sort | xargs -d '\n' md5sum) >"$pkg/DEBIAN/md5sums"
chmod 0644 "$pkg/DEBIAN/md5sums"

# Stable dates for every file (dpkg-deb takes SOURCE_DATE_EPOCH for its own headers).
find "$pkg" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +

mkdir -p "$output"
deb=$output/activator_${version}_$arch.deb
dpkg-deb --root-owner-group -Zxz --build "$pkg" "$deb" >/dev/null
echo "==> built $deb: Depends $depends, sha256 $(sha256sum "$deb" | cut -d' ' -f1)"
echo "$deb"
