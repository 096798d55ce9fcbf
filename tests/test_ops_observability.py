"""The Grafana dashboard and the Prometheus alert rules (deploy/observability) use only metrics that exist,
and the real Prometheus accepts them: `promtool check rules`, `promtool test rules`, and a Prometheus
server scraping a running gateway answers every dashboard query."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

import consumers.notify.metrics
import consumers.registrar_status  # noqa: F401 - registers the registrar's metrics
import gateway.kernel.transitions  # noqa: F401 - registers the kernel's metrics
from pgwcore.metrics import REGISTRY
from tests.chaos.harness import free_port
from tests.polling import until

OBS = Path(__file__).resolve().parent.parent / "deploy" / "observability"
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
NEEDS = "tests/ops/setup.sh installs Debian's prometheus (promtool); `make test` runs it"


def _exprs() -> dict[str, str]:
    out = {}
    for g in yaml.safe_load((OBS / "alerts.yml").read_text())["groups"]:
        for r in g["rules"]:
            out[f"alert {r['alert']}"] = r["expr"]
    dash = json.loads((OBS / "grafana-dashboard.json").read_text())
    for p in dash["panels"]:
        for t in p["targets"]:
            out[f"panel {p['title']}"] = t["expr"]
    return out


def _families() -> dict[str, tuple[set[str], set[str]]]:
    """metric family -> (sample names, label names)."""
    fams: dict[str, tuple[set[str], set[str]]] = {}
    for m in REGISTRY.collect():
        suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                    "gauge": ("",)}.get(m.type, ("",))
        labels: set[str] = set()
        for s in m.samples:
            labels |= set(s.labels)
        fams[m.name] = ({m.name + sfx for sfx in suffixes}, labels - {"le"})
    return fams


def test_every_metric_and_label_used_exists() -> None:
    """Each pgw_* series and each label a rule or panel groups or filters by is one the services export."""
    fams = _families()
    samples = {name: fam for fam, (names, _) in fams.items() for name in names}
    # Label names come from the metrics' declarations, not from samples (a fresh registry may hold none).
    declared = {m._name: set(m._labelnames) for m in REGISTRY._collector_to_names}  # type: ignore[attr-defined]
    missing = []
    for where, expr in _exprs().items():
        used = set(re.findall(r"\bpgw_[a-z_]+", expr))
        unknown = sorted(u for u in used if u not in samples)
        if unknown:
            missing.append(f"{where}: {unknown}")
            continue
        labels: set[str] = set()
        for u in used:
            labels |= declared.get(samples[u], set())
        grouped = {x.strip() for by in re.findall(r"\bby \(([^)]*)\)", expr) for x in by.split(",")}
        filtered = set(re.findall(r"\b([a-z_]+)=~?\"", expr))
        extra = sorted((grouped | filtered) - labels - {"le", "job", "instance"})
        if extra:
            missing.append(f"{where}: labels {extra} not on {sorted(used)}")
    assert not missing, "\n".join(missing)


@pytest.mark.skipif(PROMTOOL is None, reason=NEEDS)
def test_promtool_accepts_and_tests_the_rules() -> None:
    """`promtool check rules` accepts alerts.yml and `promtool test rules` proves the audit alerts fire."""
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        out = subprocess.run([PROMTOOL, *args], cwd=OBS, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(PROMETHEUS is None, reason=NEEDS)
async def test_prometheus_scrapes_a_gateway_and_answers_every_panel(make_config, nc, tmp_path: Path) -> None:
    """A real Prometheus scrapes a running gateway's /metrics; every dashboard query parses and runs."""
    from gateway.app import Gateway

    mport, pport = free_port(), free_port()
    config = make_config(ops={"metrics_port": mport})
    (tmp_path / "prom.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: pgw-gateway\n    static_configs: [{{targets: ['127.0.0.1:{mport}']}}]\n")
    async with Gateway(config, nc):
        proc = await asyncio.create_subprocess_exec(
            PROMETHEUS, f"--config.file={tmp_path / 'prom.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{pport}", stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL)
        try:
            def query(expr: str) -> dict:
                url = f"http://127.0.0.1:{pport}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
                try:
                    with urllib.request.urlopen(url, timeout=5) as r:
                        return json.loads(r.read())
                except urllib.error.HTTPError as e:
                    return json.loads(e.read())
                except OSError:
                    return {}

            async def scraped() -> bool:
                got = await asyncio.to_thread(query, 'up{job="pgw-gateway"} == 1')
                return bool(got.get("data", {}).get("result"))

            await until(scraped, timeout=60, interval=0.2, what="Prometheus scraped the gateway")
            lag = await asyncio.to_thread(query, "pgw_consumer_lag")
            assert lag["status"] == "success"
            for where, expr in _exprs().items():
                got = await asyncio.to_thread(query, expr)
                assert got.get("status") == "success", f"{where}: {got}"
        finally:
            proc.terminate()
            await proc.wait()
