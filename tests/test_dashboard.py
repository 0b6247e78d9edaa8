"""The Grafana dashboard and Prometheus config only query what the balancer and engine export.

A renamed metric would silently blank a panel; this catches it against `Metrics().render()`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from ramjet.balancer.metrics import Metrics

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "ramjet.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_names() -> set[str]:
    """Queryable series names from the `# TYPE` lines of the balancer's /metrics output."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", Metrics().render().decode(), re.M):
        base = name.removesuffix("_total") if kind == "counter" else name
        names |= {base + s for s in SUFFIXES.get(kind, ("",))}
    return names


def expressions(node) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "expr"] + [e for v in node.values() for e in expressions(v)]
    if isinstance(node, list):
        return [e for v in node for e in expressions(v)]
    return []


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queried(exprs: list[str], prefix: str) -> set[str]:
    return {m for e in exprs for m in re.findall(rf"\b{prefix}[A-Za-z0-9_:]*", e)}


def test_every_ramjet_metric_the_dashboard_queries_exists(dashboard):
    exported = exported_names()
    used = queried(expressions(dashboard), "ramjet_")
    assert len(used) >= 10
    assert used - exported == set(), f"not exported by ramjet.metrics: {sorted(used - exported)}"


def test_suffix_rules_are_strict():
    exported = exported_names()
    assert {"ramjet_requests_total", "ramjet_time_to_first_byte_seconds_bucket", "ramjet_upstream_up"} <= exported
    assert not {"ramjet_requests", "ramjet_upstream_up_total", "ramjet_time_to_first_byte_seconds"} & exported


def test_dashboard_covers_the_operator_questions(dashboard):
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("cache ratio", "turns per minute", "ttft p50", "ttft p90", "load per rank", "fenced",
                  "failover", "fail-open"):
        assert topic in titles
    exprs = " ".join(expressions(dashboard))
    assert "histogram_quantile(0.5" in exprs and "histogram_quantile(0.9" in exprs
    assert all(m.startswith("sglang:") for m in queried(expressions(dashboard), "sglang"))


def test_panels_use_the_selectable_datasource(dashboard):
    assert {"name": "datasource", "type": "datasource"}.items() <= dashboard["templating"]["list"][0].items()
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"])
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_prometheus_scrapes_the_balancer_and_the_engine():
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {"ramjet:9090", "engine:30000"}
    compose = yaml.safe_load((ROOT / "deploy" / "glm53_h200" / "docker-compose.yaml").read_text())
    assert {"ramjet", "engine"} <= compose["services"].keys()  # the scrape targets are these service names
