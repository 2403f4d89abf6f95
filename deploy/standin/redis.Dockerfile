# Stand-in for the official `redis:7.0` image, built from Debian's redis-server (7.0) on BASE_IMAGE,
# for machines that reach no container registry (scripts/compose-test.sh builds it only when
# `redis:7.0` cannot be pulled). Use it with REDIS_IMAGE=asyncrl-standin-redis:7.0.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server redis-tools \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data
# As the official image: data (the AOF) under /data, reachable from the compose network (its
# docker-entrypoint.sh adds --protected-mode no when no config file is given).
WORKDIR /data
VOLUME /data
EXPOSE 6379
ENTRYPOINT ["/bin/sh", "-c", "exec \"$0\" \"$@\" --protected-mode no"]
CMD ["redis-server"]
