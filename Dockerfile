# Ramjet balancer image (used by deploy/glm53_h200): `docker build -t ramjet-py:0.1.0 .`
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The image ships the balancer only: its shared modules, the routing core and the data plane.
# The simulator, the benchmark, the demo and the operator tools (validate, fit, check-hicache)
# run from a pip install of the checkout (README), not in the serving image.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ramjet/__init__.py ramjet/__main__.py ramjet/cli.py ramjet/errors.py ramjet/usage.py ./ramjet/
COPY ramjet/config ./ramjet/config
COPY ramjet/routing ./ramjet/routing
COPY ramjet/balancer ./ramjet/balancer
COPY ramjet/kvevents ./ramjet/kvevents
RUN pip install . \
    && rm -rf /src \
    && useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin ramjet \
    && mkdir -p /var/lib/ramjet && chown ramjet:ramjet /var/lib/ramjet

WORKDIR /
USER ramjet

# Listen on every interface inside the container; the Compose bundle publishes on 127.0.0.1 only.
ENV RJ_API_ADDR=0.0.0.0:8000 \
    RJ_METRICS_ADDR=0.0.0.0:9090
EXPOSE 8000 9090

# slim has no curl. /health is 200 while any replica serves ("ok" or "degraded"), 503 when none does.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

CMD ["ramjet", "serve"]
