#!/bin/sh
# Debian's `prometheus` package (prometheus and promtool) for tests/test_ops.py,
# installed by `make test` when missing and when it runs as root with apt-get;
# anywhere else it says why and leaves the machine alone (the Prometheus tests
# then skip and say so). Never fails the build.
#
# The package's postinst would start a prometheus service on :9090. It never
# does here: a policy-rc.d that refuses every start is in place during the
# install (invoke-rc.d and deb-systemd-invoke both obey it; one already there
# is put back afterwards), and the unit is disabled so no boot starts it. The
# test runs its own prometheus on a free port with its own config and storage.
set -u

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "prometheus: not installed, and not root: tests/test_ops.py will skip its Prometheus tests"
    echo "  (as root: apt-get install --no-install-recommends prometheus)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "prometheus: not installed and no apt-get here: tests/test_ops.py will skip its Prometheus tests"
    exit 0
fi

policy=/usr/sbin/policy-rc.d
saved="$policy.outrate-saved"
restore() {
    rm -f "$policy"
    if [ -e "$saved" ]; then mv "$saved" "$policy"; fi
}
if [ -e "$policy" ]; then mv "$policy" "$saved"; fi
trap restore EXIT
printf '#!/bin/sh\n# outrate: ops/install-prometheus.sh, during its install only\nexit 101\n' >"$policy"
chmod 755 "$policy"

echo "installing Debian's prometheus package (prometheus, promtool) for tests/test_ops.py"
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }; then
    echo "prometheus: apt-get could not install it: tests/test_ops.py will skip its Prometheus tests"
    exit 0
fi
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
    systemctl disable --now prometheus.service >/dev/null 2>&1 || true
else  # no systemd running (a container): what `systemctl disable` removes
    rm -f /etc/systemd/system/multi-user.target.wants/prometheus.service
fi
prometheus --version 2>&1 | head -n 1
