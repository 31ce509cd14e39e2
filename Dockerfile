# gpuwatchd container image, for the Helm chart in deploy/helm/gpuwatchd.
#   docker build -t REGISTRY/gpuwatchd:0.1.0 .
# The base is pinned to a full Python release; for bit-for-bit rebuilds pin its
# digest too:  --build-arg BASE=python:3.12.13-slim-bookworm@sha256:<digest>
ARG BASE=python:3.12.13-slim-bookworm

# --- build: compile systemd-python, install the pinned dependencies into a venv ---
# (tests/deploy/test_install_envs.py runs this stage's venv and pip lines without Docker)
FROM ${BASE} AS build
# Build tools for systemd-python's C extension; they stay in this stage.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev pkg-config libsystemd-dev \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# Behind a TLS-inspecting proxy: --build-arg PIP_CERT=<CA bundle inside the build>
# (scripts/build-image mounts the host's $PIP_CERT there). Unset by default.
ARG PIP_CERT
WORKDIR /src
COPY requirements.txt ./
# Python's headers come with the official Python images; a plain Debian base needs
# python3-dev for them (build stage only).
# hadolint ignore=DL3008
RUN python -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
 || { apt-get update && apt-get install -y --no-install-recommends python3-dev && rm -rf /var/lib/apt/lists/*; }
RUN python -m venv /opt/gpuwatchd \
 && /opt/gpuwatchd/bin/pip install -r requirements.txt
COPY pyproject.toml README.md ./
COPY gpuwatchd ./gpuwatchd
# The extras the image promises, constrained to the pins installed above: pip adds only
# gpuwatchd itself, and would fetch anything pyproject.toml declares but the pins lack.
RUN /opt/gpuwatchd/bin/pip install -c requirements.txt ".[systemd,pod-resources]" \
 && /opt/gpuwatchd/bin/pip check \
 && /opt/gpuwatchd/bin/gpuwatchd --version

# --- runtime: the venv on a clean base, no compiler ---
FROM ${BASE}
# libsystemd0 (journal reader, sd_notify) and libudev1 (pyudev) are in the base
# image today; naming them keeps that true if the base slims down further.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libsystemd0 libudev1 \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /var/lib/gpuwatchd /etc/gpuwatchd \
 && chown 65532:65532 /var/lib/gpuwatchd
COPY --from=build /opt/gpuwatchd /opt/gpuwatchd
ENV PATH=/opt/gpuwatchd/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# Non-root by default (plain `docker run`, the replay demo). The Helm chart runs it
# as UID 0 with every capability dropped except SYSLOG in kmsg mode, because
# Kubernetes grants added capabilities only to root and the host's journal is
# root's; see docs/deploy.md.
USER 65532:65532
EXPOSE 10370
ENTRYPOINT ["/opt/gpuwatchd/bin/gpuwatchd"]
# Built-in defaults; the chart passes --config with its ConfigMap.
CMD ["run"]

LABEL org.opencontainers.image.title="gpuwatchd" \
      org.opencontainers.image.description="Node-level GPU health daemon" \
      org.opencontainers.image.licenses="Apache-2.0"
