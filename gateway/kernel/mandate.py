"""Mandate JWT verification (spec 003 §2 "Mandate JWT", DESIGN §5.1).

A mandate is a JWT signed with EdDSA or ES256 by a trusted issuer from
configuration (``kernel.issuers``: JWT header ``kid`` -> public key PEM,
inline or a file path). Required claims: ``jti``, ``sub`` (the agent),
``so_id``, ``principal``, ``actions``, ``exp``; optional ``mission_ref``.
``kernel.revoked_jtis`` is the static revocation list; ``live_revoked`` the
live one, kept by ``gateway.kernel.revocation`` from the bus. ``aud`` must
name ``kernel.audience`` when the mandate has one (RFC 7519 §4.1.3), and
``iss`` must be ``kernel.issuer_names[kid]`` when that is configured.

The check order reports the strongest finding first: a bad signature
(nothing in the token can be trusted), then revocation, then expiry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from pgwcore.config import KernelConfig
from subjects.errors import ConfigError, PgwError
from subjects.names import TOKEN_RE

ALGORITHMS = ["EdDSA", "ES256"]
DEV_ISSUER_ROLE = "mandate_issuer"
_NUMBER = (int, float)  # a tuple built once: ``int | float`` in isinstance builds a union on every call


# Why an approval of a step permits nothing (``Denials.approval_void``, HEM_RESOLVED ``void``): how its mandate
# lapsed, in words for the agent and the verdict.
LAPSED_HOW = {
    "MANDATE_REVOKED": "was revoked",
    "MANDATE_EXPIRED": "expired",
    "SESSION_TERMINATED": "was ended (a step she did not approve ended it)",
}


class MandateError(PgwError):
    """The mandate failed verification; ``code`` is the REJECT code for the agent."""

    def __init__(self, code: str, reason: str) -> None:
        self.code = code
        self.reason = reason
        super().__init__(f"{code}: {reason}")


@dataclass(frozen=True)
class Mandate:
    jti: str
    sub: str
    so_id: str
    principal: str
    actions: tuple[str, ...]
    exp: int
    mission_ref: str | None
    issuer_kid: str
    claims: dict[str, Any]


def _load_key(kid: str, value: str) -> Any:
    text = value if "-----BEGIN" in value else None
    if text is None:
        try:
            text = Path(value).expanduser().read_text()
        except OSError as e:
            raise ConfigError(f"kernel.issuers.{kid}", f"cannot read public key file {value!r}: {e}") from e
    try:
        key = serialization.load_pem_public_key(text.encode())
    except ValueError as e:
        raise ConfigError(f"kernel.issuers.{kid}", f"not a PEM public key: {e}") from e
    if not isinstance(key, ed25519.Ed25519PublicKey | ec.EllipticCurvePublicKey):
        raise ConfigError(f"kernel.issuers.{kid}", "issuer keys must be Ed25519 (EdDSA) or P-256 (ES256)")
    if isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name != "secp256r1":
        raise ConfigError(f"kernel.issuers.{kid}", "EC issuer keys must be on P-256 (ES256)")
    return key


class MandateVerifier:
    """Verify mandate JWTs against the configured issuers and revocation list.

    An agent presents the same mandate on every step, so the outcome of the
    signature check is remembered per exact token string (bounded, oldest
    first out). That outcome depends only on the token bytes and the issuer
    keys, which are fixed when the verifier is built. The claim rules that
    depend on nothing but the token, the agent and the configuration are
    remembered per (token, agent) once they pass; revocation, expiry and
    ``nbf`` still run on each call.
    """

    cache_size = 1024

    def __init__(self, cfg: KernelConfig, data_dir: Path | None = None, *, keys_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.keys: dict[str, Any] = {kid: _load_key(kid, v) for kid, v in cfg.issuers.items()}
        if cfg.trust_dev_issuer and data_dir is not None:
            from pgwcore.keys import load_or_create

            k = load_or_create(data_dir, DEV_ISSUER_ROLE, keys_dir=keys_dir)
            self.keys.setdefault(k.kid, k.public)
        self.revoked = frozenset(cfg.revoked_jtis)
        self.live_revoked: set[str] = set()  # gateway/kernel/revocation.py
        self.revoker_keys: dict[str, Any] = {kid: _load_key(kid, v) for kid, v in cfg.revokers.items()}
        self._verified: dict[str, tuple[str, dict[str, Any]]] = {}
        # (token, agent) -> the Mandate a full check gave, the token's exp, nbf and iat as signed:
        # the next call re-runs only the revocation and time rules (verify, _check_standing).
        self._passed: dict[tuple[str, str], tuple[Mandate, float, Any, Any]] = {}

    def verify(self, token: object, *, agent: str, now: float | None = None) -> Mandate:
        if not isinstance(token, str) or not token:
            raise MandateError("MANDATE_INVALID", "the request carries no mandate JWT")
        hit = self._verified.get(token)
        if hit is None:
            hit = self._verify_signature(token)
            if len(self._verified) >= self.cache_size:
                del self._verified[next(iter(self._verified))]
            self._verified[token] = hit
        kid, signed = hit
        passed = self._passed.get((token, agent))
        if passed is not None:
            # Every rule but those of _check_standing is a function of the token, the agent and
            # the fixed configuration, and passed for this pair before: only those run again,
            # and a refusal is the one the full check would give.
            m, exp, nbf, iat = passed
            self._check_standing(m.jti, exp, nbf, iat, now)
            # A new Mandate with its own copy of the claims, as _check_claims gives.
            return Mandate(jti=m.jti, sub=m.sub, so_id=m.so_id, principal=m.principal, actions=m.actions,
                           exp=m.exp, mission_ref=m.mission_ref, issuer_kid=m.issuer_kid, claims=dict(signed))
        # A copy: the cached claims stay as the issuer signed them.
        m = self._check_claims(dict(signed), kid, agent=agent, now=now)
        if len(self._passed) >= self.cache_size:
            del self._passed[next(iter(self._passed))]
        self._passed[(token, agent)] = (m, signed["exp"], signed.get("nbf"), signed.get("iat"))
        return m

    def _verify_signature(self, token: str) -> tuple[str, dict[str, Any]]:
        """(issuer kid, claims) of a token whose signature verifies; a MandateError otherwise."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError:
            raise MandateError("MANDATE_INVALID", "the mandate is not a well-formed JWT") from None
        alg = header.get("alg")
        if alg not in ALGORITHMS:
            raise MandateError("MANDATE_INVALID", f"mandate algorithm must be one of {ALGORITHMS}")
        kid = header.get("kid")
        if kid is None and len(self.keys) == 1:
            kid = next(iter(self.keys))
        key = self.keys.get(kid) if isinstance(kid, str) else None
        if key is None:
            raise MandateError("MANDATE_INVALID", "the mandate is not from a trusted issuer")
        if (alg == "EdDSA") != isinstance(key, ed25519.Ed25519PublicKey):
            raise MandateError("MANDATE_INVALID", "the mandate algorithm does not match the issuer key")
        try:
            # Signature and required claims only: every time rule (exp, nbf, iat) is
            # _check_standing's, against the caller's clock and with kernel.clock_skew_s of
            # grace. PyJWT's own nbf / iat checks use the wall clock with no grace, and their
            # refusal would read as a bad signature.
            claims = jwt.decode(
                token,
                key,
                algorithms=[alg],
                options={"verify_exp": False, "verify_aud": False, "verify_nbf": False, "verify_iat": False,
                         "require": ["jti", "sub", "exp"]},
            )
        except jwt.MissingRequiredClaimError as e:
            raise MandateError("MANDATE_INVALID", f"the mandate lacks the {e.claim!r} claim") from None
        except jwt.InvalidTokenError:
            raise MandateError("MANDATE_INVALID", "the mandate signature does not verify") from None
        return str(kid), claims

    def _check_aud_iss(self, claims: dict[str, Any], kid: str) -> None:
        aud = claims.get("aud")
        if aud is not None:
            auds = [aud] if isinstance(aud, str) else aud
            if not isinstance(auds, list) or not all(isinstance(a, str) for a in auds):
                raise MandateError("MANDATE_INVALID", "the mandate aud must be a string or a list of strings")
            if self.cfg.audience is None:
                raise MandateError("MANDATE_INVALID", "the mandate names an audience and this gateway has none (kernel.audience)")
            if self.cfg.audience not in auds:
                raise MandateError("MANDATE_INVALID", "the mandate is not for this gateway (aud)")
        elif self.cfg.audience is not None:
            raise MandateError("MANDATE_INVALID", f"the mandate lacks the 'aud' claim (this gateway is {self.cfg.audience!r})")
        want = self.cfg.issuer_names.get(kid)
        if want is not None and claims.get("iss") != want:
            raise MandateError("MANDATE_INVALID", "the mandate iss is not the name configured for its issuer key")

    def lapsed(self, jti: str, exp: float | None, now: float | None = None) -> str | None:
        """``MANDATE_REVOKED`` or ``MANDATE_EXPIRED`` for a mandate that passed once and no longer stands
        (``exp`` None: not known, only revocation is checked); None while it stands. For an answer that
        arrives after the request it was asked for: a principal's approval of a pending step (denials.py)."""
        try:
            self._check_standing(jti, float("inf") if exp is None else exp, None, None, now)
        except MandateError as e:
            return e.code
        return None

    def _check_standing(self, jti: str, exp: Any, nbf: Any, iat: Any, now: float | None,
                        claims: dict[str, Any] | None = None, kid: str = "") -> None:
        """The rules whose answer changes after a mandate passed: revocation (spec 003 §6.2 and
        §11 Table 2, ``MANDATE_REVOKED``; the static and the live list), expiry, not-before and
        issued-at (RFC 7519 §4.1.4-6: a token issued in the future is not valid yet either), each
        with ``kernel.clock_skew_s`` of grace, in that order.

        The one place these rules live: the full check (``_check_claims``) and the remembered
        path of ``verify`` both call it, so they cannot drift apart. With ``claims`` (the full
        check), the fixed rules that come between revocation and expiry in the check order
        (``aud``, ``iss``, ``exp`` a number) run in their place; the remembered path passed them.
        """
        if jti in self.revoked or jti in self.live_revoked:
            raise MandateError("MANDATE_REVOKED", "the mandate has been revoked")
        if claims is not None:
            self._check_aud_iss(claims, kid)
            # RFC 7519 §2: exp, nbf and iat are NumericDates (JSON numbers).
            if not isinstance(exp, _NUMBER) or isinstance(exp, bool):
                raise MandateError("MANDATE_INVALID", "the mandate exp must be a number")
            for name, value in (("nbf", nbf), ("iat", iat)):
                if value is not None and (not isinstance(value, _NUMBER) or isinstance(value, bool)):
                    raise MandateError("MANDATE_INVALID", f"the mandate {name} must be a number")
        t = now if now is not None else time.time()
        if t > exp + self.cfg.clock_skew_s:
            raise MandateError("MANDATE_EXPIRED", "the mandate has expired")
        if nbf is not None and t + self.cfg.clock_skew_s < nbf:
            raise MandateError("MANDATE_INVALID", "the mandate is not yet valid")
        if iat is not None and t + self.cfg.clock_skew_s < iat:
            raise MandateError("MANDATE_INVALID", "the mandate is not yet valid (issued in the future)")

    def _check_claims(self, claims: dict[str, Any], kid: str, *, agent: str, now: float | None) -> Mandate:
        jti = claims.get("jti")
        if not isinstance(jti, str) or not jti:
            raise MandateError("MANDATE_INVALID", "the mandate jti must be a non-empty string")
        exp = claims.get("exp")
        # The standing rules, with the fixed ones that come between them in the check order.
        self._check_standing(jti, exp, claims.get("nbf"), claims.get("iat"), now, claims, kid)
        for name in ("so_id", "principal"):
            if not isinstance(claims.get(name), str) or not claims[name]:
                raise MandateError("MANDATE_INVALID", f"the mandate lacks the {name!r} claim")
        actions = claims.get("actions")
        if not isinstance(actions, list) or not all(isinstance(a, str) for a in actions):
            raise MandateError("MANDATE_INVALID", "the mandate 'actions' claim must be a list of strings")
        if claims["sub"] != agent:
            raise MandateError("MANDATE_INVALID", "the mandate was not issued to this agent")
        principal = claims["principal"].removeprefix("~")
        if not TOKEN_RE.match(principal):
            raise MandateError("MANDATE_INVALID", "the mandate principal is not a valid principal handle")
        mission_ref = claims.get("mission_ref")
        if mission_ref is not None and not isinstance(mission_ref, str):
            raise MandateError("MANDATE_INVALID", "the mandate mission_ref must be a string")
        return Mandate(
            jti=jti,
            sub=claims["sub"],
            so_id=claims["so_id"],
            principal=principal,
            actions=tuple(actions),
            exp=int(exp),
            mission_ref=mission_ref,
            issuer_kid=kid,
            claims=claims,
        )


def issue_mandate(
    private_key: Any,
    kid: str,
    *,
    agent: str,
    so_id: str,
    principal: str,
    actions: list[str],
    ttl_s: int = 3600,
    jti: str | None = None,
    mission_ref: str | None = None,
    now: float | None = None,
    aud: str | None = None,
    iss: str | None = None,
) -> str:
    """Sign a mandate (dev/demo and tests): EdDSA for Ed25519 keys, ES256 for P-256 keys."""
    import time
    import uuid

    t = int(now if now is not None else time.time())
    claims: dict[str, Any] = {
        "jti": jti or str(uuid.uuid4()),
        "sub": agent,
        "so_id": so_id,
        "principal": principal,
        "actions": list(actions),
        "iat": t,
        "exp": t + ttl_s,
    }
    if mission_ref is not None:
        claims["mission_ref"] = mission_ref
    if aud is not None:
        claims["aud"] = aud
    if iss is not None:
        claims["iss"] = iss
    alg = "EdDSA" if isinstance(private_key, ed25519.Ed25519PrivateKey) else "ES256"
    return jwt.encode(claims, private_key, algorithm=alg, headers={"kid": kid})
