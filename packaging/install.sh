#!/usr/bin/env bash
# Install activator on a VM as a systemd service (run as root), or remove it.
#
# Usage: packaging/install.sh [BINARY]              install or upgrade
#        packaging/install.sh --uninstall [--purge] remove the service and the binary;
#                                                   --purge removes /etc/activator too
# BINARY defaults to dist/activator (packaging/build.sh makes it).
#
# Installs:
#   /usr/local/bin/activator                  the executable (replaced atomically)
#   /etc/systemd/system/activator.service     the unit
#   /etc/activator/activator.yaml             from config/example.yaml, only if absent:
#                                             an existing configuration is never touched
# then, when systemd runs the machine: validates the configuration, daemon-reload,
# enable --now, and a restart when the binary or the unit changed while it was running.
# Running it again changes nothing. The unit uses DynamicUser=yes, so no user is
# created; the configuration must stay readable by others (mode 0644).
#
# DESTDIR=/some/dir installs under that directory instead and never calls systemctl
# (what it would run is printed): for packaging and tests, no root needed.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DESTDIR=${DESTDIR:-}
BIN_PATH=/usr/local/bin/activator
UNIT_PATH=/etc/systemd/system/activator.service
CONF_DIR=/etc/activator
CONF_PATH=$CONF_DIR/activator.yaml

usage() {
  sed -n '2,8s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
}

say() { printf 'install.sh: %s\n' "$*"; }
die() { printf 'install.sh: %s\n' "$*" >&2; exit 1; }

mode=install
purge=0
binary=
while [ $# -gt 0 ]; do
  case "$1" in
    --uninstall) mode=uninstall ;;
    --purge) purge=1 ;;
    -h|--help) usage; exit 0 ;;
    -*) usage >&2; exit 2 ;;
    *) [ -z "$binary" ] || { usage >&2; exit 2; }; binary=$1 ;;
  esac
  shift
done
if [ $purge = 1 ] && [ $mode != uninstall ]; then
  die "--purge goes with --uninstall"
fi
if [ -z "$DESTDIR" ] && [ "$(id -u)" != 0 ]; then
  die "run as root (or set DESTDIR to install into a directory)"
fi

# systemctl only on a live system whose PID 1 is systemd (sd_booted(3)'s test).
use_systemctl=0
if [ -n "$DESTDIR" ]; then
  why_not="DESTDIR is set"
elif [ -d /run/systemd/system ]; then
  use_systemctl=1
else
  why_not="systemd is not PID 1"
fi
systemctl_or_say() {
  if [ $use_systemctl = 1 ]; then
    systemctl "$@"
  else
    say "skipped ($why_not): systemctl $*"
  fi
}

# Copies $1 to $DESTDIR$2 with mode $3 unless identical; sets changed=1 if it copied.
# Goes through a temporary file and a rename, so a running binary is replaced, not
# overwritten (which would fail with "Text file busy").
changed=0
put() {
  local src=$1 dest=$DESTDIR$2 mode=$3
  if [ -f "$dest" ] && cmp -s "$src" "$dest"; then
    chmod "$mode" "$dest"
    return 0
  fi
  mkdir -p "$(dirname "$dest")"
  install -m "$mode" "$src" "$dest.tmp.$$"
  mv -f "$dest.tmp.$$" "$dest"
  say "installed $dest"
  changed=1
}

if [ $mode = uninstall ]; then
  if [ -e "$DESTDIR$UNIT_PATH" ] || [ -e "$DESTDIR$BIN_PATH" ]; then
    systemctl_or_say disable --now activator.service || true
  fi
  for path in "$UNIT_PATH" "$BIN_PATH"; do
    if [ -e "$DESTDIR$path" ]; then
      rm -f "$DESTDIR$path"
      say "removed $DESTDIR$path"
    fi
  done
  if [ $purge = 1 ]; then
    for path in "$CONF_DIR" "$UNIT_PATH.d"; do
      if [ -e "$DESTDIR$path" ]; then
        rm -rf "$DESTDIR$path"
        say "removed $DESTDIR$path"
      fi
    done
  elif [ -e "$DESTDIR$CONF_DIR" ]; then
    say "kept $DESTDIR$CONF_DIR (--purge removes it)"
  fi
  systemctl_or_say daemon-reload
  exit 0
fi

binary=${binary:-$ROOT/dist/activator}
[ -f "$binary" ] && [ -x "$binary" ] || die "no executable at $binary (build it with packaging/build.sh)"
unit_src=$ROOT/systemd/activator.service
conf_src=$ROOT/config/example.yaml
[ -f "$unit_src" ] || die "missing $unit_src"

put "$binary" "$BIN_PATH" 0755
put "$unit_src" "$UNIT_PATH" 0644

mkdir -p "$DESTDIR$CONF_DIR"
chmod 0755 "$DESTDIR$CONF_DIR"
if [ -e "$DESTDIR$CONF_PATH" ]; then
  say "kept the existing $DESTDIR$CONF_PATH"
  # DynamicUser=yes: the service reads the file as a transient, unprivileged user.
  if [ -z "$(find "$DESTDIR$CONF_PATH" -perm -o=r)" ]; then
    say "warning: $DESTDIR$CONF_PATH is not readable by others; the service cannot read it (chmod 0644)"
  fi
else
  [ -f "$conf_src" ] || die "missing $conf_src"
  install -m 0644 "$conf_src" "$DESTDIR$CONF_PATH"
  say "installed $DESTDIR$CONF_PATH from config/example.yaml: edit it, then systemctl reload activator"
fi

if [ $use_systemctl = 1 ]; then
  "$BIN_PATH" check -c "$CONF_PATH" >/dev/null || die "$CONF_PATH is not valid (see above); fix it, then run this again"
  was_active=0
  systemctl is-active --quiet activator.service && was_active=1
  systemctl daemon-reload
  systemctl enable --now activator.service
  if [ $was_active = 1 ] && [ $changed = 1 ]; then
    systemctl restart activator.service
    say "restarted activator (new binary or unit)"
  fi
  systemctl --no-pager --lines=0 status activator.service || true
else
  systemctl_or_say daemon-reload
  systemctl_or_say enable --now activator.service
fi
