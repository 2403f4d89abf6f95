#!/usr/bin/env bash
# Make sure the local Redis (6379) and PostgreSQL (5432) the tests use are running, and that
# Debian's chromium (the status page's browser test) is installed; install what is missing from
# Debian's packages. Idempotent; does nothing when all are already there.
set -euo pipefail
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
apt_install() {
  as_root apt-get update -qq >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null
}
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

[ -x /usr/bin/chromium ] || apt_install chromium
command -v systemd-analyze >/dev/null || apt_install systemd  # tests/test_deploy.py verifies the units

# The binaries even when a Redis already answers: the Redis Cluster tests start their own nodes
# (redis-server --cluster-enabled yes) and join them (redis-cli --cluster create).
command -v redis-server >/dev/null || apt_install redis-server
command -v redis-cli >/dev/null || apt_install redis-tools
if ! port_open 6379; then
  mkdir -p /var/lib/redis /var/log/redis 2>/dev/null || true
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  for _ in $(seq 50); do port_open 6379 && break; sleep 0.1; done
fi
port_open 6379 || { echo "Redis did not start on 6379" >&2; exit 1; }

if ! port_open 5432; then
  ls /etc/postgresql >/dev/null 2>&1 || apt_install postgresql
  ver=$(ls /etc/postgresql | sort -V | tail -1)
  as_root pg_ctlcluster --skip-systemctl-redirect "$ver" main start
  for _ in $(seq 100); do port_open 5432 && break; sleep 0.1; done
fi
port_open 5432 || { echo "PostgreSQL did not start on 5432" >&2; exit 1; }
