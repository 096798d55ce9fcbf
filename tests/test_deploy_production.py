"""The production recipe's files (deploy/production, deploy/kubernetes) say what docs/operations.md promises.

The recipe's services are run for real by tests/chaos/test_chaos_production.py (three nodes,
operator mode, mutual TLS, R3, two gateways). Here the recipe's own node configuration
(deploy/production/nats.conf, with the PKI and route credential of make_secrets.py and the block of
`pgw accounts`) is checked by ``nats-server -t`` and run as a three-node cluster on loopback, where a
rogue nats-server holding a party's client certificate, or a route certificate without the route
password, is refused as a route; the compose and Kubernetes files are read for one secret per
service, keys.create = false, three nodes, two gateways, and routes with a CA and credential of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
import yaml
from cryptography import x509

from gateway.security.accounts import Operator, OperatorAuth
from gateway.security.permissions import Permissions
from pgwcli.main import build_parser
from pgwcore.config import load_config
from pgwcore.connect import connect
from pgwcore.identity import Party
from pgwcore.server import nats_server_binary
from pgwcore.tls import TlsFiles
from tests.polling import until
from tests.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
PROD = ROOT / "deploy" / "production"
K8S = ROOT / "deploy" / "kubernetes"
SERVICES = ("gateway", "signer", "registrar", "notifier")
AGENT = "agent-planner"  # the party whose client certificate the rogue holds
# A node's log line for a route connection it refused; the address is the peer's (an ephemeral port when
# the peer dialled in, the peer's route port when the node dialled out).
INBOUND_REFUSAL = re.compile(r"127\.0\.0\.1:(\d+) - rid:\d+ - (TLS route handshake error|authentication error)")


def make_secrets(folder: Path, nodes: list[str], clients: tuple[str, ...] = SERVICES) -> None:
    """The recipe's own set-up, run as an operator runs it: deploy/production/make_secrets.py."""
    args = [sys.executable, str(PROD / "make_secrets.py"), "--dir", str(folder)]
    args += [a for n in nodes for a in ("--node", n)] + [a for c in clients for a in ("--client", c)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def node_config(secrets: Path, *, client: int, monitor: int, route: int, store: Path) -> str:
    """deploy/production/nats.conf for a loopback node: ports, the secrets folder and the store replaced."""
    conf = (PROD / "nats.conf").read_text()
    for old, new in (('listen: "0.0.0.0:4222"', f'listen: "127.0.0.1:{client}"'),
                     ('http: "0.0.0.0:8222"', f'http: "127.0.0.1:{monitor}"'),
                     ('listen: "0.0.0.0:6222"', f'listen: "127.0.0.1:{route}"'),
                     ('store_dir: "/data"', f'store_dir: "{store}"')):
        assert conf.count(old) == 1, f"deploy/production/nats.conf no longer has {old!r} once"
        conf = conf.replace(old, new)
    return conf.replace("/etc/nats/tls/", f"{secrets / 'tls'}/")


def provision(root: Path) -> tuple[OperatorAuth, Path]:
    """`pgw accounts` for tenant acme, and a probe user that may publish and subscribe anywhere in the account."""
    op = Operator(root)
    auth = op.provision("acme", "pgw", [Party("service", s) for s in SERVICES])
    probe = op.mint_user("acme", "pgw", Party("service", "probe"), root / "probe.creds",
                         perms=Permissions(pub_allow=(">",), sub_allow=(">",)))
    return auth, probe


def test_node_config_is_accepted_by_nats_server(tmp_path: Path) -> None:
    """deploy/production/nats.conf, with make_secrets.py's PKI and route credential and `pgw accounts`' block in
    place, passes `nats-server -t`; its routes trust the route CA, which is not the client CA."""
    secrets = tmp_path / "secrets"
    make_secrets(secrets, ["nats-1", "nats-2", "nats-3"])
    provision(tmp_path / "accounts")
    conf = (PROD / "nats.conf").read_text()
    (secrets / "nats.conf").write_text(conf.replace("/etc/nats/tls/", f"{secrets / 'tls'}/")
                                       .replace('store_dir: "/data"', f'store_dir: "{tmp_path / "js"}"'))
    shutil.copy(tmp_path / "accounts" / "operator.conf", secrets / "operator.conf")
    out = subprocess.run([nats_server_binary(), "-t", "-c", str(secrets / "nats.conf")], capture_output=True,
                         text=True, timeout=30, env={**os.environ, "SERVER_NAME": "nats-1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sync_interval: always" in conf and "verify:    true" in conf and "include ./operator.conf" in conf
    cluster = conf[conf.index("cluster {"):]
    assert '"/etc/nats/tls/route-ca.pem"' in cluster and "include ./cluster.conf" in cluster
    client_ca = x509.load_pem_x509_certificate((secrets / "tls" / "ca.pem").read_bytes())
    route_ca = x509.load_pem_x509_certificate((secrets / "tls" / "route-ca.pem").read_bytes())
    route = x509.load_pem_x509_certificate((secrets / "tls" / "route.pem").read_bytes())
    assert route.issuer == route_ca.subject != client_ca.subject
    auth = (secrets / "cluster.conf").read_text()
    assert "authorization {" in auth and auth.count("nats-route://pgw-route:") == 3
    for path in [secrets / "cluster.conf", *secrets.glob("*/*.pem")]:
        assert path.stat().st_mode & 0o777 == 0o600, path


def test_make_secrets_never_overwrites(tmp_path: Path) -> None:
    """A second run of make_secrets.py into the same folder changes nothing and says which file is there."""
    make_secrets(tmp_path, ["nats-1"])
    before = (tmp_path / "cluster.conf").read_text()
    out = subprocess.run([sys.executable, str(PROD / "make_secrets.py"), "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "exists" in out.stderr
    assert (tmp_path / "cluster.conf").read_text() == before


@dataclass
class Server:
    """A nats-server process started from a config file, its log on stderr in ``log``."""

    name: str
    client: int
    monitor: int
    log: Path
    proc: asyncio.subprocess.Process

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    async def routes(self) -> set[str]:
        """The server names of this server's route peers, from its monitoring port's /routez."""
        def get() -> dict:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor}/routez", timeout=5) as r:
                return json.load(r)
        return {r.get("remote_name", "") for r in (await asyncio.to_thread(get)).get("routes") or []}


@contextlib.asynccontextmanager
async def servers(specs: list[tuple[str, Path, int, int]]) -> AsyncIterator[list[Server]]:
    """Start one nats-server per (name, config, client port, monitoring port); stop them all on the way out."""
    started: list[Server] = []
    try:
        for name, conf, client, monitor in specs:
            log = conf.with_suffix(".log")
            with log.open("wb") as f:
                proc = await asyncio.create_subprocess_exec(
                    nats_server_binary(), "-c", str(conf), stdout=f, stderr=subprocess.STDOUT,
                    env={**os.environ, "SERVER_NAME": name})
            started.append(Server(name, client, monitor, log, proc))
        for srv in started:
            await _listening(srv)
        yield started
    finally:
        for s in started:
            if s.proc.returncode is None:
                s.proc.terminate()
        for s in started:
            await s.proc.wait()


class PortTaken(Exception):
    """A server could not listen: another process took a port ``free_port`` gave (see tests/ports.py)."""


async def _listening(srv: Server, timeout: float = 20.0) -> None:
    """Wait until ``srv`` logs that it is ready (and, with a cluster block, that it listens for routes);
    PortTaken when it ended on a port someone else holds. The server's log is its only readiness signal."""

    async def ready() -> bool:
        text = srv.text()
        if "[FTL]" in text or srv.proc.returncode is not None:
            if "address already in use" in text:
                raise PortTaken(srv.name)
            raise RuntimeError(f"{srv.name} did not start:\n{text[-2000:]}")
        return "Server is ready" in text and ("Cluster name is" not in text or "Listening for route connections" in text)

    await until(ready, timeout=timeout, what=lambda: f"{srv.name} ready:\n{srv.text()[-2000:]}")


def rogue_config(*, name: str, client: int, monitor: int, route: int, tls: str, operator_block: str,
                 account: str, peers: list[int]) -> str:
    """A nats-server that dials the cluster's route ports with ``tls`` and no route password. It names the
    system account and the tenant's account by their public keys (public: every node's operator block
    holds them), so what it routes lands in the tenant's account, and it lets anyone in there."""
    system = next(json.loads(line.split(":", 1)[1]) for line in operator_block.splitlines()
                  if line.startswith("system_account:"))
    routes = ", ".join(f"nats-route://127.0.0.1:{p}" for p in peers)
    return (f'server_name: {name}\nlisten: "127.0.0.1:{client}"\nhttp: "127.0.0.1:{monitor}"\n'
            f'accounts {{\n  "{system}": {{}}\n'
            f'  "{account}": {{ users: [{{user: mallory, password: mallory}}] }}\n}}\n'
            f'system_account: "{system}"\n'
            f'cluster {{\n  name: pgw\n  listen: "127.0.0.1:{route}"\n  {tls}\n  routes: [{routes}]\n}}\n')


@pytest.mark.slow
@pytest.mark.security
async def test_a_client_certificate_is_not_a_route_credential(tmp_path: Path) -> None:
    """The recipe's three nodes form their routes and carry traffic; a nats-server holding an agent's client
    certificate and the client CA, or the route certificate without the route password, never becomes a route
    peer: the nodes log the refusal (a TLS failure, an authentication failure), no /routez lists it, and
    nothing published through it reaches the cluster, nor anything published on the cluster reaches it."""
    ports = [(free_port(), free_port(), free_port()) for _ in range(3)]  # client, monitoring, route
    secrets = tmp_path / "secrets"
    make_secrets(secrets, [f"127.0.0.1:{r}" for _, _, r in ports], clients=("gateway", AGENT))
    auth, probe_creds = provision(tmp_path / "accounts")
    shutil.copy(tmp_path / "accounts" / "operator.conf", secrets / "operator.conf")
    nodes = []
    for i, (client, monitor, route) in enumerate(ports, 1):
        conf = secrets / f"nats-{i}.conf"
        conf.write_text(node_config(secrets, client=client, monitor=monitor, route=route,
                                    store=tmp_path / f"js-{i}"))
        nodes.append((f"nats-{i}", conf, client, monitor))
    tls_files = TlsFiles(str(secrets / "tls" / "ca.pem"), str(secrets / "clients" / "gateway.pem"),
                         str(secrets / "clients" / "gateway-key.pem"))
    agent_cert, agent_key = secrets / "clients" / f"{AGENT}.pem", secrets / "clients" / f"{AGENT}-key.pem"
    def rogue_specs() -> tuple[list[tuple[int, int, int]], list[tuple[str, Path, int, int]]]:
        """The two rogues on fresh ports (drawn again when a port was taken meanwhile)."""
        rogue_ports = [(free_port(), free_port(), free_port()) for _ in range(2)]
        rogues = []
        # insecure: the rogue does not check the node's certificate; what refuses it is the node's TLS (which asks
        # for a certificate from the route CA) or the node's route authorization.
        for name, (client, monitor, route), tls in (
            ("rogue-client-cert", rogue_ports[0],
             f'tls {{ cert_file: "{agent_cert}", key_file: "{agent_key}", ca_file: "{secrets / "tls" / "ca.pem"}", '
             "insecure: true }"),
            ("rogue-no-password", rogue_ports[1],
             f'tls {{ cert_file: "{secrets / "tls" / "route.pem"}", key_file: "{secrets / "tls" / "route-key.pem"}", '
             f'ca_file: "{secrets / "tls" / "route-ca.pem"}" }}'),
        ):
            conf = tmp_path / f"{name}.conf"
            conf.write_text(rogue_config(name=name, client=client, monitor=monitor, route=route, tls=tls,
                                         operator_block=auth.server_block, account=auth.account_public,
                                         peers=[r for _, _, r in ports]))
            rogues.append((name, conf, client, monitor))
        return rogue_ports, rogues

    rogue_ports, rogues = rogue_specs()

    async with servers(nodes) as cluster:
        names = {s.name for s in cluster}

        async def formed() -> bool:
            try:
                return all([await s.routes() == names - {s.name} for s in cluster])
            except OSError:  # a monitoring port not listening yet
                return False

        def logs() -> str:
            return "\n".join(f"--- {s.name}\n{s.text()[-3000:]}" for s in cluster)

        await until(formed, timeout=60, interval=0.2, what=lambda: "the three routes up:\n" + logs())
        url = ",".join(f"tls://127.0.0.1:{s.client}" for s in cluster)
        on_1 = await connect(f"tls://127.0.0.1:{cluster[0].client}", creds=str(probe_creds), tls=tls_files, name="on-1")
        on_3 = await connect(f"tls://127.0.0.1:{cluster[2].client}", creds=str(probe_creds), tls=tls_files, name="on-3")
        try:
            subject = f"pgw.route-probe.{uuid.uuid4().hex}"
            sub = await on_1.subscribe(subject)
            await on_1.flush()

            async def carried() -> bool:  # interest reaches node 3 over its route a moment after the flush
                await on_3.publish(subject, b"legit")
                await on_3.flush()
                with contextlib.suppress(TimeoutError, nats.errors.TimeoutError):
                    return (await sub.next_msg(timeout=0.2)).data == b"legit"
                return False

            await until(carried, timeout=30, what=f"a message from node 3 to node 1 over {url}")

            async with contextlib.AsyncExitStack() as rogue_stack:
                for _attempt in range(3):  # a port free_port gave may be taken by then (tests/ports.py)
                    try:
                        by_cert, by_cert_only = await rogue_stack.enter_async_context(servers(rogues))
                        break
                    except PortTaken:
                        rogue_ports, rogues = rogue_specs()
                else:
                    pytest.fail("the rogues found no free ports in three draws")
                route_ports = {r for _, _, r in ports} | {r for _, _, r in rogue_ports}

                def refused(s: Server) -> bool:
                    """The node refused an incoming route (from an ephemeral port, not a route port it dials)
                    at TLS, and another at authorization."""
                    text = s.text()
                    inbound = {kind for port, kind in INBOUND_REFUSAL.findall(text) if int(port) not in route_ports}
                    return {"TLS route handshake error", "authentication error"} <= inbound

                async def all_refused() -> bool:
                    return all(refused(s) for s in cluster)

                # Every node has refused both rogues (each dials all three, again every second).
                await until(all_refused, timeout=60, interval=0.2,
                            what=lambda: "both rogues refused by every node:\n" + logs()
                            + f"\n--- {by_cert.name}\n{by_cert.text()[-2000:]}"
                            + f"\n--- {by_cert_only.name}\n{by_cert_only.text()[-2000:]}")
                for s in cluster:
                    assert await s.routes() == names - {s.name}, s.name
                for rogue in (by_cert, by_cert_only):
                    assert await rogue.routes() == set(), rogue.name
                    mallory = await nats.connect(f"nats://mallory:mallory@127.0.0.1:{rogue.client}",
                                                 name="mallory", allow_reconnect=False)
                    try:
                        await mallory.publish(subject, b"forged")
                        await mallory.flush()
                        tap = await mallory.subscribe(">")  # after the forged message: it sees not its own
                        await mallory.flush()
                        await on_3.publish(subject, b"secret")
                        await on_3.flush()
                        # Node 1's subscriber gets node 3's message. Had the rogue been a route its forged one,
                        # published first on a route to node 1 directly, would come too, and its tap would
                        # hold node 3's. (A late copy of the probe's "legit" may come first.)
                        seen = [(await sub.next_msg(timeout=5)).data]
                        while seen[-1] != b"secret":
                            seen.append((await sub.next_msg(timeout=5)).data)
                        assert b"forged" not in seen, f"{rogue.name}: the cluster received a message through it"
                        with pytest.raises(nats.errors.TimeoutError):
                            got = await sub.next_msg(timeout=1)
                            pytest.fail(f"{rogue.name}: the cluster received {got.data!r} through the rogue")
                        with pytest.raises(nats.errors.TimeoutError):
                            got = await tap.next_msg(timeout=1)
                            pytest.fail(f"{rogue.name} read {got.subject} {got.data!r} from the cluster")
                    finally:
                        await mallory.close()
        finally:
            await on_1.close()
            await on_3.close()


def test_compose_recipe_has_three_nodes_two_gateways_and_a_secret_per_service() -> None:
    """compose: three NATS nodes with the route credential, R3 streams made once, two gateways, and each service
    its own creds and client cert."""
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
    for n in ("nats-1", "nats-2", "nats-3"):  # the route credential make_secrets.py writes, where nats.conf includes it
        assert "./secrets/cluster.conf:/etc/nats/cluster.conf:ro" in services[n]["volumes"], n
    # The nodes' folder (secrets/tls) holds no service's client key: those are in secrets/clients.
    client_files = [v["file"] for k, v in doc["secrets"].items() if k.endswith(("-tls-cert", "-tls-key"))]
    assert client_files and all(f.startswith("./secrets/clients/") for f in client_files)


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
    # Routes trust the route CA from their own Secret (not tlsCA, the client CA) and need cluster.conf's password.
    cluster = values["config"]["cluster"]
    assert cluster["tls"]["merge"]["ca_file"] == "/etc/nats-certs/cluster/ca.crt"
    assert cluster["tls"]["secretName"] != values["tlsCA"]["secretName"]
    assert cluster["merge"]["$include"] == "cluster-auth/cluster.conf"
    assert {"op": "remove", "path": "/routes"} in cluster["patch"]
    assert not cluster.get("routeURLs"), "a route password in values lands in the ConfigMap"
    mounts = {m["value"]["name"]: m["value"]["mountPath"] for m in values["container"]["patch"]}
    volumes = {v["value"]["name"]: v["value"]["secret"]["secretName"] for v in values["podTemplate"]["patch"]}
    assert mounts["cluster-auth"] == "/etc/nats-config/cluster-auth" and volumes["cluster-auth"] == "nats-route-auth"
    assert mounts["operator"] == "/etc/nats-config/" + values["config"]["merge"]["$include"].split("/")[0]
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
