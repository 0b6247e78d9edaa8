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
COPY pyproject.toml README.md constraints.txt ./
COPY ramjet/__init__.py ramjet/__main__.py ramjet/cli.py ramjet/errors.py ramjet/usage.py ./ramjet/
COPY ramjet/config ./ramjet/config
COPY ramjet/routing ./ramjet/routing
COPY ramjet/balancer ./ramjet/balancer
COPY ramjet/kvevents ./ramjet/kvevents
RUN pip install -c constraints.txt . \
    && rm -rf /src \
    && useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin ramjet \
    && mkdir -p /var/lib/ramjet && chown ramjet:ramjet /var/lib/ramjet

WORKDIR /
USER ramjet

# Listen on every interface inside the container; the Compose bundle publishes on 127.0.0.1 only.
ENV RJ_API_ADDR=0.0.0.0:8000 \
    RJ_METRICS_ADDR=0.0.0.0:9090
EXPOSE 8000 9090

# Liveness, not readiness: /livez is 200 whenever the process answers. An orchestrator that acts on
# this status (Swarm replaces unhealthy tasks, autoheal restarts them) must not restart a balancer that
# is draining after SIGTERM or whose every engine rank is fenced: /readyz and /health are 503 then, and
# a restart would only cut its streams (docs/operations.md, "Shutdown and rolling upgrades"). Asked on
# the metrics listener (RJ_METRICS_ADDR above: probe 8000 if you turn it off), which a balancer full
# of clients (RJ_CLIENT_MAX_CONNECTIONS) still answers.
# Readiness (/readyz) belongs to whatever sends traffic; the Compose bundle overrides this check with it.
# slim has no curl.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9090/livez', timeout=4)"]

CMD ["ramjet", "serve"]
