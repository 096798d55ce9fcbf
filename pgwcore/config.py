"""Configuration: one TOML file, validated at start with the field named.

The types are frozen msgspec Structs decoded with ``forbid_unknown_fields`` so
that a typo'd key fails start-up instead of being silently ignored
(STYLE.md "Configuration"). Environment overrides are applied only at the CLI
edge (``pgwcli.main``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct, field

from pgwcore.notifier_config import NotifierConfig, check_http_url
from pgwcore.slack_config import SlackConfig
from pgwcore.tls import TlsFiles
from subjects.errors import ConfigError
from subjects.names import Subjects, check_token, principal_token

DEFAULT_DATA_DIR = ".pgw"
# The folders a configuration file names for pgw's own state are relative to that file, not to
# the folder a command happens to start in: an MCP host starts `pgw` wherever it likes.
_FILE_RELATIVE = (("data_dir",), ("security", "creds_dir"), ("keys", "dir"))


class _Section(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    pass


class ServerConfig(_Section):
    """The embedded nats-server that ``pgw up`` runs."""

    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=-1, le=65535)] = 4222
    # Off unless asked (issue 19): the monitoring HTTP port answers anyone on the host
    # with connections, subscriptions and stream details, and has no authentication.
    monitor_port: Annotated[int, Meta(ge=-1, le=65535)] | None = None
    websocket_port: Annotated[int, Meta(ge=-1, le=65535)] = 8443
    max_payload: Annotated[int, Meta(ge=1024, le=64 * 1024 * 1024)] = 8 * 1024 * 1024
    # `pgw up` restarts its server when it dies, this many times; then it exits non-zero with one line.
    restart_limit: Annotated[int, Meta(ge=0, le=100)] = 5
    # Serve TLS with client certificates from a development CA in {data_dir}/tls (`pgw up --dev-tls`).
    tls: bool = False

    def __post_init__(self) -> None:
        if self.host not in ("127.0.0.1", "localhost", "::1"):
            raise ConfigError("server.host", "the embedded server listens on loopback only")


class LimitsConfig(_Section):
    """The gateway's own size limits (DESIGN §7)."""

    max_body_bytes: Annotated[int, Meta(ge=1024)] = 1024 * 1024
    max_depth: Annotated[int, Meta(ge=4, le=512)] = 64
    max_string_chars: Annotated[int, Meta(ge=64)] = 64 * 1024
    # A turn (JSON array) of more envelopes is refused whole (invalid_envelope_shape), one
    # outcome: below it every envelope gets its own (spec 002 "Wire serialization").
    max_turn_envelopes: Annotated[int, Meta(ge=1)] = 1024


class AgentConfig(_Section):
    """One agent: the principals it may address (spec 000 §8.4)."""

    principals: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for p in self.principals:
            principal_token(p)


class GatewayConfig(_Section):
    """Gateway worker settings."""

    batch: Annotated[int, Meta(ge=1, le=1024)] = 64
    ack_wait_s: Annotated[float, Meta(gt=0)] = 30.0
    max_deliver: Annotated[int, Meta(ge=1)] = 10
    duplicate_window_s: Annotated[float, Meta(gt=0)] = 3600.0
    # spec 000 §13: a principal's free text (free_text answer, dialogue objection, clarification
    # answers) is kept in full this long after it is published to the agent, then only its digest.
    answer_text_keep_s: Annotated[float, Meta(gt=0)] = 3600.0


class SecurityConfig(_Section):
    """Server-enforced isolation (DESIGN §7): the parties ``pgw creds`` makes users for.

    Agents come from ``agents``, principals from every agent's ``principals``
    plus ``principals`` here; ``ops`` names read-only ops users.
    """

    enabled: bool = True  # `pgw up` runs the embedded server with the generated block
    principals: list[str] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    auditors: list[str] = field(default_factory=list)  # audit principals (gateway/kernel/audit.py)
    creds_dir: str = ""  # default: {data_dir}/creds
    demo: bool = True  # open mode (no [agents]): also make `pgw demo`'s parties (demo-agent, alice)

    def __post_init__(self) -> None:
        for p in self.principals:
            principal_token(p)
        for o in self.ops:
            check_token(o, "ops user name")
        for a in self.auditors:
            check_token(a, "auditor name")


class ExecutorConfig(_Section):
    """One executor kind of the gate (docs/gate.md): the actions it serves, and how long the
    kernel waits for its answer before recording the action ``dispatched_unconfirmed``."""

    actions: list[str] = field(default_factory=list)
    timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 10.0
    # After a timeout (or a restart) the kernel keeps asking the executor's _result endpoint this
    # long for the result it did not see, then leaves the action dispatched_unconfirmed.
    follow_up_s: Annotated[float, Meta(ge=0, le=30 * 86400)] = 300.0


class KernelConfig(_Section):
    """The IDP kernel (spec 003, DESIGN §5): mandates, policy, HEM. See docs/kernel.md."""

    enabled: bool = True
    # Trusted mandate issuers: JWT header kid -> public key PEM (inline or a file path).
    issuers: dict[str, str] = field(default_factory=dict)
    # Also trust the dev issuer key of `pgw mandate issue` ({data_dir}/keys/mandate_issuer).
    trust_dev_issuer: bool = False
    revoked_jtis: list[str] = field(default_factory=list)
    # Keys (kid -> PEM) that may revoke mandates live besides the issuers (gateway/kernel/revocation.py).
    revokers: dict[str, str] = field(default_factory=dict)
    # RFC 7519 §4.1.3: this gateway's audience; a mandate naming an audience must name it.
    audience: str | None = None
    # Issuer kid -> the `iss` its mandates must carry (checked when listed).
    issuer_names: dict[str, str] = field(default_factory=dict)
    clock_skew_s: Annotated[float, Meta(ge=0, le=600)] = 30.0
    # Folder of *.cedar policies (+ optional schema.cedarschema); none = deny everything.
    policy_dir: str | None = None
    thin_accepted: bool = True
    thin_refused_actions: list[str] = field(default_factory=list)  # spec 003 §7 IDP_THIN_NOT_ACCEPTED
    mismatch_hem_threshold: Annotated[int, Meta(ge=0)] = 3  # spec 003 §5.2(g); 0 = never
    hem_enabled: bool = True
    hem_expires_in_s: Annotated[int, Meta(ge=1, le=30 * 86400)] = 3600
    # spec 003 §9: "reject" (the default) keeps flagged personal data out of the append-only
    # log; "flag" admits it with a warning and records where it was found.
    pii: Literal["flag", "reject"] = "reject"
    # spec 003 §9 names: names (or full names) flagged in goal and reasoning descriptions,
    # matched case-insensitively as whole words; titles like "Mr Smith" are flagged always.
    pii_names: list[str] = field(default_factory=list)
    # spec 003 §8.7: actions whose executed transition must pass a kernel gate. No gate
    # exists yet, so such an action is denied (GATE_REQUIRED) and a report claiming it refused.
    gated_actions: list[str] = field(default_factory=list)
    # The gate (docs/gate.md): executor kind -> the actions it serves. An action served by an
    # executor is gated: it runs only when the kernel dispatches it (agent.{agent}.act).
    executors: dict[str, ExecutorConfig] = field(default_factory=dict)
    log_permits: bool = True
    # The event log's head is anchored outside it this often, and at drain (gateway/kernel/checkpoint.py).
    checkpoint_interval_s: Annotated[float, Meta(ge=0, le=3600)] = 5.0
    # A PERMIT without its transition report this long after is closed by a timeout verdict
    # (gateway/kernel/overdue.py); 0 = never.
    report_deadline_s: Annotated[float, Meta(ge=0)] = 3600.0
    # The gate's sweep of open dispatches (docs/gate.md) runs at start, then this often; None:
    # half the shortest executor timeout, between 0.2 and 5 s; 0: at start only.
    gate_sweep_s: Annotated[float, Meta(ge=0, le=3600)] | None = None
    # denied action -> candidate paths (each a list of actions); offered only when derivable.
    suggested_paths: dict[str, list[list[str]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from subjects.errors import SubjectError
        from subjects.gate import check_action_token, check_kind

        served: dict[str, str] = {}
        for kind, ex in self.executors.items():
            try:
                check_kind(kind)
                for a in ex.actions:
                    check_action_token(a)
            except SubjectError as e:
                raise ConfigError(f"kernel.executors.{kind}", str(e)) from None
            clash = [k for k in self.executors if k != kind and k.upper() == kind.upper()]
            if clash:
                raise ConfigError(f"kernel.executors.{kind}", f"differs from {clash[0]} only in case (one results bucket)")
            for a in ex.actions:
                if a in served:
                    raise ConfigError(f"kernel.executors.{kind}", f"action {a} is served by {served[a]} already")
                served[a] = kind

    def executor_of(self, action: str) -> str | None:
        """The executor kind that serves ``action`` (docs/gate.md), or None."""
        for kind, ex in self.executors.items():
            if action in ex.actions:
                return kind
        return None


class SurfacesConfig(_Section):
    """Principal surfaces (issue 6, docs/surfaces.md): ``pgw surface`` and ``pgw surface-web``."""

    web_host: str = "127.0.0.1"
    web_port: Annotated[int, Meta(ge=0, le=65535)] = 8765
    # The NATS WebSocket URL the browser connects to; "" = the embedded server's listener.
    ws_url: str = ""
    # Where principals open the page through a TLS proxy in front of web_port (issue 17,
    # docs/surfaces.md "Serving over HTTPS"), e.g. "https://gw.example.org"; its origin
    # is then also allowed on the WebSocket listener. "" = loopback only.
    public_url: str = ""

    def __post_init__(self) -> None:
        if self.web_host not in ("127.0.0.1", "localhost", "::1"):
            raise ConfigError("surfaces.web_host", "the browser surface serves credentials; loopback only")
        if self.ws_url and not self.ws_url.startswith(("ws://", "wss://")):
            raise ConfigError("surfaces.ws_url", "must start with ws:// or wss://")
        if self.public_url:
            from urllib.parse import urlsplit

            u = urlsplit(self.public_url)
            if u.scheme != "https" or not u.hostname or u.path not in ("", "/") or u.query or u.fragment:
                raise ConfigError(
                    "surfaces.public_url",
                    "must be https://host[:port] (service workers and push need a secure context)",
                )

    @property
    def public_origin(self) -> str | None:
        return self.public_url.rstrip("/") if self.public_url else None


class OpsConfig(_Section):
    """Observability and reliability (issue 8): metrics, services API, dead letters."""

    metrics_port: Annotated[int, Meta(ge=0, le=65535)] | None = None  # None = no /metrics server
    metrics_addr: str = "127.0.0.1"
    lag_interval_s: Annotated[float, Meta(gt=0)] = 5.0  # consumer-lag gauge refresh
    micro: bool = True  # register with the NATS services API ($SRV.PING/INFO/STATS)
    dead_letter: bool = True  # after max_deliver: dead-letter record + engine_failure verdict
    # pgwcore/durability.py: at start, are the streams a service writes R3 or fsynced on every write?
    durability: Literal["warn", "refuse", "off"] = "warn"
    nats_monitor_url: str | None = None  # the server's monitoring endpoint (reads /varz sync_always)
    # /healthz: a durable consumer with work waiting and no ack for this long is stalled (pgwcore/health.py)
    stall_after_s: Annotated[float, Meta(gt=0)] = 120.0


class SignerConfig(_Section):
    """The capsule signer (spec 004, DESIGN §6)."""

    developer: str = "principal-gateway"  # capsule developer / CWT iss when a verdict names no agent
    authority: str = "urn:pgw:gateway-policy"  # §5.4 opaque authority reference of policy dispositions
    tenant_salt_file: str | None = None  # §13 per-tenant salt; default {data_dir}/signer/tenant_salt (0600)
    durable: str = "pgw-signer"
    # verdicts per fetch = per atomic batch; the signer takes at most 500 (a verdict may yield two
    # statements, and the server's atomic batch holds 1000 messages). 500: every atomic batch of a
    # file stream is staged in a file store of its own at the server, made and removed per batch,
    # so fewer, larger batches cost the server less per capsule (benchmarks/performance-changes.md).
    batch: Annotated[int, Meta(ge=1, le=1000)] = 500
    ack_wait_s: Annotated[float, Meta(gt=0)] = 30.0
    ledger_duplicate_window_s: Annotated[float, Meta(gt=0)] = 86400.0
    # deliveries after which a verdict still waiting for its supersedes parent is logged as a
    # warning; it keeps waiting (spec 004 §5.4.4: signed without its chain block, its parent stays open)
    parent_wait_deliveries: Annotated[int, Meta(ge=1)] = 5
    # The capsule profile signed from now on (consumers/profiles.py): "2" = spec 004 (draft -01,
    # reference verifier 0.1.0), "4" = the current drafts (draft-mih-scitt-agent-action-capsule-05,
    # reference verifier 0.3 and later). pgw verify reads both; a replay keeps its first profile.
    capsule_format: Literal["2", "4"] = "4"  # the profile the newest reference verifier (0.12.0) accepts
    # Processes that sign the capsules beside the signer (consumers/signer_pool.py): 0 signs in the
    # signer's own process; "auto" is 1 on a machine with two cores or more, 0 on one core.
    workers: Annotated[int, Meta(ge=0, le=32)] | Literal["auto"] = "auto"


class RegistrarConfig(_Section):
    """The SCITT registrar (spec 004 §3.2, SCRAPI). No ts_url: capsules wait in the queue."""

    ts_url: str | None = None
    # receipt key: Ed25519 hex, a PEM file, a JWK/JWKS file or inline JSON (EdDSA, ES256, ES384);
    # unset = the TS's own jwks / jwks_uri, pinned on first use (docs/capsules.md "Registration")
    ts_public_key: str | None = None
    ts_key_id: str | None = None  # kid of ts_public_key when the key itself names none
    receipt_leaf: Literal["auto", "statement", "payload"] = "auto"  # the TS's Merkle leaf construction
    durable: str = "pgw-registrar"
    max_failures: Annotated[int, Meta(ge=1)] = 5  # permanent refusals before the dead-letter stream
    backoff_base_s: Annotated[float, Meta(gt=0)] = 1.0
    backoff_max_s: Annotated[float, Meta(gt=0)] = 60.0
    http_timeout_s: Annotated[float, Meta(gt=0)] = 10.0
    poll_timeout_s: Annotated[float, Meta(gt=0)] = 30.0

    def __post_init__(self) -> None:
        if self.ts_url:  # else every registration fails as if the TS were down, and is retried for ever
            check_http_url(self.ts_url, "registrar.ts_url")


class ContractConfig(_Section):
    """spec 002 "Envelope Contract" for one agent: the kinds it may emit besides the universals."""

    accepts: list[str] = field(default_factory=list)
    refusal_mode: Literal["fail-node", "discard-and-warn"] = "fail-node"


class SecretsConfig(_Section):
    """spec 002 SR-1: what the redaction stage scrubs (besides every ``secret:`` token)."""

    values: list[str] = field(default_factory=list)  # literal secrets
    env: list[str] = field(default_factory=list)  # names of environment variables holding secrets
    files: list[str] = field(default_factory=list)  # files; each non-blank line is a secret

    def __post_init__(self) -> None:
        for i, v in enumerate(self.values):
            if len(v.strip()) < 4:
                raise ConfigError(f"pipeline.secrets.values[{i}]", "a secret shorter than 4 characters would redact ordinary text")


LintMode = Literal["reject", "warn", "off"]


class LintsConfig(_Section):
    """spec 000 §6 construction discipline lints: ``reject`` (malformed), ``warn`` or ``off``."""

    synopsis_one_sentence: LintMode = "reject"  # §6.1
    synopsis_hedge: LintMode = "reject"  # §6.1, §7.1
    leading_stem: LintMode = "reject"  # §6.5
    findings_restate_synopsis: LintMode = "warn"  # §6.2 ("SHOULD be omitted")
    recommendation_not_action: LintMode = "reject"  # §6.3
    option_is_hatch: LintMode = "reject"  # §6.6 ("they do not include the escape hatches")


class VendorKindConfig(_Section):
    """A configured vendor kind (spec 002 "Vendor-namespaced kinds") with its JSON Schema file."""

    schema_file: str
    schema_version: Annotated[int, Meta(ge=0)] = 1


class WorkflowConfig(_Section):
    """spec 001 WorkflowDeclaration (``workflow_id`` is the table key).

    ``authoritative_intent`` has no default: spec 001 "Every workflow MUST
    declare whether it may emit authoritative envelopes", so a table without
    it fails start-up with the field named. ``enforcement_mode`` (docs/pipeline.md)
    defaults to the safe ``NON_AUTHORITATIVE_ONLY``. ``oracles``: the oracle ids
    this workflow's records may name (empty: any).
    """

    authoritative_intent: Literal["authoritative", "non_authoritative"]
    enforcement_mode: Literal["INLINE", "ASYNC", "NON_AUTHORITATIVE_ONLY"] = "NON_AUTHORITATIVE_ONLY"
    oracles: list[Annotated[str, Meta(min_length=1, max_length=256)]] = field(default_factory=list)


class NarrativeConfig(_Section):
    """spec 001 narrative policy enforced on top of each envelope's own ``policy``."""

    forbidden_markers: list[str] = field(default_factory=lambda: [
        "verified", "confirmed", "certified", "guaranteed", "approved", "authorized",
        "authoritative", "official", "definitive", "proven", "clinically proven",
    ])
    enforce_grammar_mode: bool = True


class PipelineConfig(_Section):
    """The envelope pipeline (spec 002, spec 000, spec 001; docs/pipeline.md)."""

    envelopes_per_turn: Annotated[int, Meta(ge=1, le=1024)] = 32
    schema_rounds: Annotated[int, Meta(ge=0, le=100)] = 3
    clarification_rounds: Annotated[int, Meta(ge=0, le=100)] = 3
    envelope_strictness: Literal["warn", "strict"] = "warn"
    # schema.request naming a kind this host does not support (issue 15 point 3; docs/pipeline.md):
    # spec 002 leaves it open, the official conformance scenario expects "accept", the official
    # schema's description says refuse with unknown_envelope_kind.
    schema_request_unknown_kind: Literal["accept", "refuse"] = "accept"
    # spec 000 §7.2 (docs/pipeline.md "Dual veto"): after a dialogue veto, a moment of the same agent to
    # the same principal is "on the same decision" when it has the vetoed moment's decision_class, or when
    # its stem words or its option labels overlap the vetoed moment's by at least this Jaccard similarity.
    dual_veto_similarity: Annotated[float, Meta(gt=0, le=1)] = 0.5
    schema_versions: dict[str, Annotated[int, Meta(ge=0)]] = field(default_factory=dict)
    contracts: dict[str, ContractConfig] = field(default_factory=dict)  # agent -> contract
    secrets: SecretsConfig = field(default_factory=SecretsConfig)
    lints: LintsConfig = field(default_factory=LintsConfig)
    vendor_kinds: dict[str, VendorKindConfig] = field(default_factory=dict)
    workflows: dict[str, WorkflowConfig] = field(default_factory=dict)
    narrative: NarrativeConfig = field(default_factory=NarrativeConfig)
    dedup_ttl_s: Annotated[float, Meta(gt=0)] = 30 * 86400.0
    clarification_expires_in_s: Annotated[int, Meta(ge=1, le=30 * 86400)] | None = None

    def __post_init__(self) -> None:
        for name in self.vendor_kinds:
            if not name.startswith("vendor.") or name.startswith("vendor.pgw."):
                raise ConfigError(f"pipeline.vendor_kinds.{name}", "a configured kind must be vendor-namespaced (vendor.<host>.<kind>) and not vendor.pgw.*")


class TlsConfig(_Section):
    """TLS to the NATS server (pgwcore/tls.py): the CA that signed it, and a client certificate if it asks."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("tls", "cert and key go together: give both (a client certificate and its key) or neither")

    def files(self) -> TlsFiles | None:
        return TlsFiles(self.ca, self.cert, self.key) if (self.ca or self.cert) else None


class KeysConfig(_Section):
    """Signing keys (kernel, signer, the notifier's VAPID key) and the signer's salt.

    ``create = true`` (the default, so `make run` just works) makes a missing key on
    first start. A production deployment sets ``create = false``: a key volume mounted
    at the wrong path then stops the service with the file named, instead of signing
    silently with a brand-new key that no verifier trusts (docs/operations.md).
    """

    create: bool = True
    # Where the key folders (kernel/, signer/, vapid/, mandate_issuer/) live; default {data_dir}/keys.
    # A secrets mount of its own keeps keys out of the data volume (deploy/production).
    dir: str = ""


class Config(_Section):
    """Top-level configuration. Every setting has a safe default."""

    prefix: str = "pgw"
    data_dir: str = DEFAULT_DATA_DIR
    nats_url: str = "nats://127.0.0.1:4222"
    creds: str | None = None
    operator: str = "principal-gateway"
    log_format: Literal["auto", "json", "console"] = "auto"
    # spec 000 §8.4: with no [agents] bindings any agent may address any principal ("open mode").
    # Kept for development, but `pgw up` refuses it unless asked for here (or with `pgw up --open`).
    open: bool = False
    server: ServerConfig = field(default_factory=ServerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    agents: dict[str, AgentConfig] = field(default_factory=dict)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    surfaces: SurfacesConfig = field(default_factory=SurfacesConfig)
    ops: OpsConfig = field(default_factory=OpsConfig)
    signer: SignerConfig = field(default_factory=SignerConfig)
    registrar: RegistrarConfig = field(default_factory=RegistrarConfig)
    notifier: NotifierConfig = field(default_factory=NotifierConfig)  # issue 17, docs/notifications.md
    slack: SlackConfig = field(default_factory=SlackConfig)  # the Slack surface, docs/surfaces.md
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    keys: KeysConfig = field(default_factory=KeysConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            Subjects(self.prefix)
        except ValueError as e:
            raise ConfigError("prefix", str(e)) from e
        for name in self.agents:
            try:
                check_token(name, "agent token")
            except ValueError as e:
                raise ConfigError(f"agents.{name}", str(e)) from e

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir).expanduser()

    @property
    def keys_path(self) -> Path:
        """The folder of the signing keys: ``keys.dir``, else ``{data_dir}/keys``."""
        return Path(self.keys.dir).expanduser() if self.keys.dir else self.data_path / "keys"

    def bound_principals(self, agent: str) -> list[str] | None:
        """Principals bound to ``agent``; None when no binding is configured at all (open mode)."""
        if not self.agents:
            return None
        cfg = self.agents.get(agent)
        return [principal_token(p) for p in cfg.principals] if cfg else []


OPEN_MODE_LINE = ("OPEN MODE: no [agents.NAME] principals = [...] bindings are configured, so any agent may address "
                  "any principal (spec 000 §8.4); for development only")


def open_mode_message(config: Config) -> tuple[bool, str] | None:
    """The word on open mode (spec 000 §8.4): (refuse?, what to say), or None when agents are bound.

    With no ``[agents]`` bindings any agent may address any principal: ``pgw up`` refuses
    unless ``open = true`` (development only) and prints the refusal; allowed, the gateway
    says :data:`OPEN_MODE_LINE` once, in its log, wherever it runs.
    """
    if config.agents:
        return None
    if not config.open:
        return True, (
            "pgw: refusing to start in OPEN MODE: no [agents.NAME] principals = [...] bindings are configured, so "
            "any agent could address any principal (spec 000 §8.4 single-surface delivery). Bind your agents, or, "
            "for development only, set `open = true` in the config (or run `pgw up --open`); "
            "`pgw up --quickstart` binds the quick start's agents."
        )
    return False, OPEN_MODE_LINE


def default_data_dir() -> str:
    """The data folder when nothing names it (no ``--data-dir``, ``$PGW_DATA_DIR`` or ``data_dir`` in a file):
    ``.pgw`` in the current folder when there is one; else the ``.pgw`` beside the Python environment
    ``pgw`` runs from (the checkout where ``make run`` made both), when it exists; else ``.pgw`` here,
    where ``pgw up`` makes it. The second case lets a program that starts ``.venv/bin/pgw`` in another
    folder (an MCP host) find the checkout's credentials without being told."""
    if Path(DEFAULT_DATA_DIR).is_dir():
        return DEFAULT_DATA_DIR
    beside = Path(sys.prefix).parent / DEFAULT_DATA_DIR
    return str(beside) if sys.prefix != sys.base_prefix and beside.is_dir() else DEFAULT_DATA_DIR


def load_config(path: str | os.PathLike[str] | None, **overrides: Any) -> Config:
    """Load ``path`` (or the defaults) and apply ``overrides``; fail with the field named."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            raw = msgspec.toml.decode(p.read_bytes())
        except FileNotFoundError as e:
            raise ConfigError(str(p), "file not found") from e
        except msgspec.DecodeError as e:
            raise ConfigError(str(p), f"not valid TOML: {e}") from e
        _relative_to(raw, p.resolve().parent)
    for k, v in overrides.items():
        if v is not None:
            raw[k] = v
    _check_workflows(raw)
    try:
        return msgspec.convert(raw, Config)
    except msgspec.ValidationError as e:
        # msgspec names the path, e.g. "Expected `int`, got `str` - at `$.limits.max_depth`".
        msg = str(e)
        where = msg.rsplit("at `", 1)[-1].rstrip("`") if "at `" in msg else "$"
        raise ConfigError(where, msg) from e


def _relative_to(raw: dict[str, Any], base: Path) -> None:
    """Make the state folders a file names (``_FILE_RELATIVE``) relative to the file's folder."""
    for keys in _FILE_RELATIVE:
        section = raw
        for k in keys[:-1]:
            section = section.get(k) if isinstance(section.get(k), dict) else {}
        value = section.get(keys[-1])
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            section[keys[-1]] = str(base / value)


def _check_workflows(raw: dict[str, Any]) -> None:
    """Name the workflow whose intent is missing (msgspec would say ``workflows[...]``)."""
    pipeline = raw.get("pipeline")
    workflows = pipeline.get("workflows") if isinstance(pipeline, dict) else None
    for name, wf in (workflows or {}).items() if isinstance(workflows, dict) else ():
        if isinstance(wf, dict) and "authoritative_intent" not in wf:
            # spec 001 "Workflow-Level Authoritative Intent": every workflow MUST declare it.
            raise ConfigError(
                f"pipeline.workflows.{name}.authoritative_intent",
                'missing: every workflow MUST declare authoritative_intent = "authoritative" or "non_authoritative" (spec 001)',
            )
