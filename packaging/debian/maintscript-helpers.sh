# Shared by postinst, prerm and postrm: build-deb.sh puts this file in place of their
# "#HELPERS#" line (as debhelper fills in its own token), so that the three agree on the
# unit and on when systemd may be told anything.
# shellcheck shell=sh disable=SC2034 # (used by the scripts this file goes into)
UNIT=activator.service

# systemctl is for the live root under a running systemd only. DPKG_ROOT is set when
# dpkg installs into another directory (dpkg --root with --force-script-chrootless):
# paths are prefixed with it and systemd is never called. systemd runs the machine when
# /run/systemd/system exists (sd_booted(3)); ACTIVATOR_SYSTEMD_RUN_DIR stands in for
# that directory in the package's tests, so that they can simulate a running systemd.
systemd_is_live() {
	[ -z "${DPKG_ROOT:-}" ] && [ -d "${ACTIVATOR_SYSTEMD_RUN_DIR:-/run/systemd/system}" ]
}
