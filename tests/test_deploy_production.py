"""The production recipe's files (deploy/production, deploy/kubernetes) say what docs/operations.md promises.

The recipe itself is run for real by tests/chaos/test_chaos_production.py (three nodes, operator
mode, mutual TLS, R3, two gateways); here the real nats-server checks the recipe's node
configuration (``nats-server -t``) with a generated operator block and certificates, and the
compose and Kubernetes files are read for one secret per service, keys.create = false, three
nodes and two gateways.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

from cli.main import build_parser
from gateway.security.accounts import Operator
from pgwcore.config import load_config
from pgwcore.identity import Party
from pgwcore.server import nats_server_binary
from pgwcore.tls import make_dev_ca

ROOT = Path(__file__).resolve().parent.parent
PROD = ROOT / "deploy" / "production"
K8S = ROOT / "deploy" / "kubernetes"
SERVICES = ("gateway", "signer", "registrar", "notifier")


def test_node_config_is_accepted_by_nats_server(tmp_path: Path) -> None:
    """deploy/production/nats.conf, with `pgw accounts`' block and a CA's certificates in place, passes `nats-server -t`."""
    ca = make_dev_ca(tmp_path / "tls")
    # The recipe's route pair; a development CA's server pair stands in for it here.
    (tmp_path / "tls" / "route.pem").write_bytes(ca.server_cert.read_bytes())
    (tmp_path / "tls" / "route-key.pem").write_bytes(ca.server_key.read_bytes())
    op = Operator(tmp_path / "accounts")
    op.provision("acme", "pgw", [Party("service", s) for s in SERVICES])
    conf = (PROD / "nats.conf").read_text().replace("/etc/nats/tls/", f"{tmp_path / 'tls'}/") \
        .replace('store_dir: "/data"', f'store_dir: "{tmp_path / "js"}"')
    (tmp_path / "nats.conf").write_text(conf)
    (tmp_path / "operator.conf").write_text((tmp_path / "accounts" / "operator.conf").read_text())
    out = subprocess.run([nats_server_binary(), "-t", "-c", str(tmp_path / "nats.conf")], capture_output=True,
                         text=True, timeout=30, env={**os.environ, "SERVER_NAME": "nats-1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sync_interval: always" in conf and "verify:    true" in conf and "include ./operator.conf" in conf


def test_compose_recipe_has_three_nodes_two_gateways_and_a_secret_per_service() -> None:
    """compose: three NATS nodes, R3 streams made once, two gateways, and each service its own creds and client cert."""
    doc = yaml.safe_load((PROD / "compose.yaml").read_text())
    services = doc["services"]
    assert {"nats-1", "nats-2", "nats-3"} <= set(services)
    assert services["streams"]["command"][-3:] == ["streams", "--replicas", "3"]
    gateways = [n for n in services if n.startswith("gateway-")]
    assert len(gateways) == 2
    subcommands = set(build_parser()._subparsers._group_actions[0].choices)
    creds_of: dict[str, str] = {}
    for name in [*gateways, "signer", "registrar", "notifier"]:
        svc = services[name]
        role = name.split("-")[0]
        assert svc["command"][-1] in subcommands and svc["command"][-1] == role
        secrets = {s["target"]: s["source"] for s in svc["secrets"]}
        assert set(secrets) == {"nats-creds", "nats-ca", "nats-client-cert", "nats-client-key"}, name
        assert secrets["nats-creds"] == f"{role}-creds"
        creds_of[name] = doc["secrets"][secrets["nats-creds"]]["file"]
        assert svc["environment"]["NATS_URL"].count("tls://") == 3
    assert creds_of["signer"].endswith("service-signer.creds") and creds_of["gateway-a"] == creds_of["gateway-b"]
    assert len({creds_of[n] for n in ("gateway-a", "signer", "registrar", "notifier")}) == 4
    assert not any("ports" in services[n] for n in ("nats-1", "nats-2", "nats-3")), "no NATS port on the host"


def test_services_config_refuses_missing_keys_and_weak_durability() -> None:
    """deploy/production/pgw.toml loads, with keys.create = false, TLS, durability refuse, and operator mode."""
    cfg = load_config(PROD / "pgw.toml")
    assert cfg.keys.create is False
    assert cfg.tls.cert and cfg.tls.key and cfg.tls.ca
    assert cfg.ops.durability == "refuse" and cfg.ops.metrics_port == 9090
    assert cfg.security.enabled is False


def test_kubernetes_example_matches_the_recipe() -> None:
    """Kubernetes: the NATS chart values run three TLS nodes with JetStream; two gateway replicas; probes on /healthz."""
    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    assert values["config"]["cluster"]["replicas"] == 3 and values["config"]["jetstream"]["enabled"]
    assert values["config"]["nats"]["tls"]["merge"]["verify"] is True
    assert values["config"]["jetstream"]["merge"]["sync_interval"] == "always"
    docs = list(yaml.safe_load_all((K8S / "pgw.yaml").read_text()))
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert set(deployments) == {f"pgw-{s}" for s in SERVICES}
    assert deployments["pgw-gateway"]["spec"]["replicas"] == 2
    secrets = set()
    for name, dep in deployments.items():
        pod = dep["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["readinessProbe"]["httpGet"]["path"] == "/healthz", name
        nats_secret = next(v["secret"]["secretName"] for v in pod["volumes"] if v["name"] == "nats")
        secrets.add(nats_secret)
    assert len(secrets) == len(SERVICES), "one NATS secret per service"
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    assert "create = false" in cm["data"]["pgw.toml"]
