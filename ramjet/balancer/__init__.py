"""The balancer a user deploys (`ramjet serve`), in layers; each imports only the layers below it
(an import-linter contract in pyproject.toml; docs/architecture.md tells the request path through them):

  server/    the processes: listeners, signals and the shutdown phases, RJ_WORKERS supervision
  edge/      what clients and operators talk to: the client-facing app and protocol limits, the operator API
  runtime/   one balancer: its parts built and wired, started and stopped, and its memory across restarts
  proxy/     one request: decide, attempt, relay, record; the listeners that learn from each attempt
  precise/   precise mode: the engines' KV events, matching a request against them, trust per replica
  cluster/   the replicas: topology, their state (the Fleet), probes, the engines' own load
  engines/   talking to engines: the HTTP client, and what engines say about themselves
  metrics.py the Prometheus collectors every layer writes to
"""
