"""Configuration: one TOML file, validated at start with the field named.

The types are frozen msgspec Structs decoded with ``forbid_unknown_fields`` so
that a typo'd key fails start-up instead of being silently ignored
(STYLE.md "Configuration"). Environment overrides are applied only at the CLI
edge (``gateway.cli``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct, field

from subjects.errors import ConfigError
from subjects.names import Subjects, check_token, principal_token

DEFAULT_DATA_DIR = ".pgw"


class _Section(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    pass


class ServerConfig(_Section):
    """The embedded nats-server that ``pgw up`` runs."""

    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=-1, le=65535)] = 4222
    monitor_port: Annotated[int, Meta(ge=-1, le=65535)] = 8222
    websocket_port: Annotated[int, Meta(ge=-1, le=65535)] = 8443
    max_payload: Annotated[int, Meta(ge=1024, le=64 * 1024 * 1024)] = 8 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.host not in ("127.0.0.1", "localhost", "::1"):
            raise ConfigError("server.host", "the embedded server listens on loopback only")


class LimitsConfig(_Section):
    """The gateway's own size limits (DESIGN §7)."""

    max_body_bytes: Annotated[int, Meta(ge=1024)] = 1024 * 1024
    max_depth: Annotated[int, Meta(ge=4, le=512)] = 64
    max_string_chars: Annotated[int, Meta(ge=64)] = 64 * 1024


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


class Config(_Section):
    """Top-level configuration. Every setting has a safe default."""

    prefix: str = "pgw"
    data_dir: str = DEFAULT_DATA_DIR
    nats_url: str = "nats://127.0.0.1:4222"
    creds: str | None = None
    operator: str = "principal-gateway"
    log_format: Literal["auto", "json", "console"] = "auto"
    server: ServerConfig = field(default_factory=ServerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    agents: dict[str, AgentConfig] = field(default_factory=dict)
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

    def bound_principals(self, agent: str) -> list[str] | None:
        """Principals bound to ``agent``; None when no binding is configured at all (open mode)."""
        if not self.agents:
            return None
        cfg = self.agents.get(agent)
        return [principal_token(p) for p in cfg.principals] if cfg else []


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
    for k, v in overrides.items():
        if v is not None:
            raw[k] = v
    try:
        return msgspec.convert(raw, Config)
    except msgspec.ValidationError as e:
        # msgspec names the path, e.g. "Expected `int`, got `str` - at `$.limits.max_depth`".
        msg = str(e)
        where = msg.rsplit("at `", 1)[-1].rstrip("`") if "at `" in msg else "$"
        raise ConfigError(where, msg) from e
