# Stand-in for the official `postgres:16` image: Debian 12's postgresql-15 (Debian 12 has no 16) on
# BASE_IMAGE, with an entrypoint that does what the official one does with POSTGRES_USER,
# POSTGRES_PASSWORD and POSTGRES_DB. scripts/compose-test.sh builds it only when `postgres:16` cannot
# be pulled. Use it with POSTGRES_IMAGE=asyncrl-standin-postgres:15.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends postgresql-15 \
 && rm -rf /var/lib/apt/lists/*
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
VOLUME /var/lib/postgresql/data
EXPOSE 5432
ENTRYPOINT ["/bin/sh", "/usr/local/bin/postgres-entrypoint.sh"]
CMD ["postgres"]
