# syntax=docker/dockerfile:1
# The epd image: `pip install .` of this repository (the wire's generated code is built into the wheel; Ray
# comes at the version pyproject.toml pins) on Python 3.11, with `epd`, `ray` and redis-server on PATH.
#
#   docker build -t epd:0.1.0 .                                    CPU torch (the default variant)
#   docker build --build-arg VARIANT=cuda -t epd:0.1.0-cuda .      CUDA torch: PyPI's CUDA wheels bring the CUDA
#                                                                  runtime; the host needs the NVIDIA driver and
#                                                                  container toolkit (helm: image.tag 0.1.0-cuda)
#   docker run --rm -p 8000:8000 epd:0.1.0 epd serve --mode colocated   (the demo model; see docs/kubernetes.md)
#
# BASE must provide Python 3.11 and pip (python:3.11-slim-bookworm by default; any Debian/Ubuntu image with
# python3.11 works, e.g. one built locally where no registry is reachable).
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS build
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# cpu: PyTorch's CPU index (no CUDA libraries in the image); cuda: PyPI's default torch, built with CUDA
ARG TORCH_INDEX_cpu=https://download.pytorch.org/whl/cpu
ARG TORCH_INDEX_cuda=https://pypi.org/simple
# optional: a folder of wheels to prefer (e.g. `podman build -v /opt/wheels:/opt/wheels --build-arg PIP_FIND_LINKS=/opt/wheels`)
ARG PIP_FIND_LINKS
# optional: a CA bundle for pip behind a TLS-intercepting proxy (mounted at build time like the wheels)
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3.11 -m venv /opt/epd
ENV PATH=/opt/epd/bin:$PATH
# torch first, pinned, from the variant's index: a bare requirement would resolve a multi-GB CUDA build
RUN set -eu; case "$VARIANT" in \
      cpu) index="$TORCH_INDEX_cpu" ;; cuda) index="$TORCH_INDEX_cuda" ;; \
      *) echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 2 ;; esac; \
    pip install --index-url "$index" --extra-index-url https://pypi.org/simple "torch==${TORCH_VERSION}"
COPY . /src
RUN pip install /src && rm -rf /src && python -c "import epd.worker.v1.worker_pb2, controlplane.serve"

FROM ${BASE}
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="epd" org.opencontainers.image.description="disaggregated encode/prefill/decode serving" \
      org.opencontainers.image.version="0.1.0" ai.epd.variant="${VARIANT}"
# redis-server: `epd serve` without a Redis URL starts a private one (the chart runs its own Redis instead)
# wget: the KubeRay operator (1.1 up to its 2026 releases) injects liveness/readiness probes into the Ray head
# and worker containers that run `wget`; without it KubeRay restarts the Ray containers forever.
RUN apt-get update && apt-get install -y --no-install-recommends redis-server wget && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/epd /opt/epd
ENV PATH=/opt/epd/bin:$PATH PYTHONUNBUFFERED=1 EPD_STATE_DIR=/var/lib/epd
RUN useradd --create-home --uid 1000 epd && mkdir -p /var/lib/epd && chown epd /var/lib/epd
USER epd
WORKDIR /home/epd
EXPOSE 8000
# inside a container the API must listen beyond loopback to be published; Ray itself stays on loopback
ENV EPD_API__HOST=0.0.0.0
CMD ["epd", "serve"]
