# The kvgate image: `kvgate serve` on 0.0.0.0:8080 (set KVGATE_TOKEN: a non-loopback bind
# requires bearer-token auth). Build: docker build -t kvgate . ; run it with compose.yaml.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# Mooncake's wheel links libibverbs even for TCP transfers.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the CPU index: a bare "torch" requirement would pull GBs of CUDA wheels.
ARG TORCH_SPEC=torch==2.13.0
RUN pip install --index-url https://download.pytorch.org/whl/cpu "${TORCH_SPEC}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY connectors ./connectors
COPY serde ./serde
COPY gpu ./gpu
RUN pip install ".[all]"

# An unprivileged user owning the disk tier's directory.
RUN useradd --system --uid 10001 --home-dir /var/lib/kvgate --create-home kvgate
USER kvgate
WORKDIR /var/lib/kvgate
ENV KVGATE_DATA_DIR=/var/lib/kvgate/data

EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"]
CMD ["kvgate", "serve", "--host", "0.0.0.0", "--port", "8080"]
