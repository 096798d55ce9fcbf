"""compose.yaml wires nats + gateway + signer + registrar + notifier to one NATS URL with a healthy JetStream server."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pgwcli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent


def load() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_services_and_nats_url_wiring():
    """Every pgw service runs a real `pgw` subcommand against nats://nats:4222 after nats is healthy."""
    doc = load()
    services = doc["services"]
    assert set(services) == {"nats", "gateway", "signer", "registrar", "notifier"}
    nats = services["nats"]
    assert nats["image"].startswith("nats:") and "alpine" in nats["image"]
    assert "-js" in nats["command"]
    # Development only: no auth, so the client port is published on the host's loopback, never every interface.
    assert "127.0.0.1:4222:4222" in [p.split("#")[0].strip() for p in nats["ports"]]
    assert not any(p.strip().startswith("4222") for p in nats["ports"])
    # issue 19: the unauthenticated monitoring port is published on the host's loopback only
    assert "127.0.0.1:8222:8222" in [p.split("#")[0].strip() for p in nats["ports"]]
    assert not any(p.strip().startswith("8222") for p in nats["ports"])
    assert "8222/healthz" in " ".join(nats["healthcheck"]["test"])
    conf_src = next(v.split(":")[0] for v in nats["volumes"] if v.endswith("nats.conf:ro"))
    conf = (ROOT / conf_src).read_text()
    assert re.search(r"sync_interval:\s*always", conf)
    listen_port = re.search(r'listen:\s*"[^"]*:(\d+)"', conf).group(1)
    subcommands = set(build_parser()._subparsers._group_actions[0].choices)
    for name in ("gateway", "signer", "registrar", "notifier"):
        svc = services[name]
        assert svc["environment"]["NATS_URL"] == f"nats://nats:{listen_port}"
        assert svc["depends_on"]["nats"]["condition"] == "service_healthy"
        assert svc["command"][0] in subcommands, f"{name}: `pgw {svc['command'][0]}` does not exist"
        assert svc["build"] == "."
    assert (ROOT / "Dockerfile").read_text().count('ENTRYPOINT ["pgw"]') == 1


def test_the_image_holds_every_package_pgw_installs():
    """The Dockerfile copies each top-level package pyproject.toml installs (the command line's pgwcli/ included), so `pgw` in the image imports."""
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in include}
    copied = set(re.findall(r"^COPY (\w+) \./\1$", (ROOT / "Dockerfile").read_text(), re.M))
    assert "pgwcli" in packages and packages <= copied, f"not copied into the image: {sorted(packages - copied)}"


def test_docker_compose_config_accepts_it():
    """Where a compose CLI exists, `docker-compose config` validates the file (checked here only when present)."""
    cli = shutil.which("docker-compose")
    if cli is None:
        pytest.skip("no docker-compose CLI on this machine; test_services_and_nats_url_wiring checks the file")
    out = subprocess.run([cli, "-f", str(ROOT / "compose.yaml"), "config", "--quiet"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
