"""docs/contract.md, the contract of record, against the code: each side names nothing the other lacks.

Read from the code (``ast`` over every package of the repository but the
tests and the benchmarks, so it does not matter where the command line
lives, plus introspection of ``subjects/``):

- subjects: every builder of ``subjects/`` (``Subjects`` and the module
  functions that return a ``{prefix}.…`` f-string), called with every channel
  it takes, and every ``{prefix}.…`` f-string anywhere else (``gateway/security/permissions.py`` aside: its
  lists are the generated permission block, compared verbatim);
- streams and buckets: ``pgwcore.streams.stream_plans`` and ``KV_BUCKETS``,
  every ``StreamConfig(name=…)``, ``KeyValueConfig(bucket=…)`` and
  ``ensure_kv(js, NAME)``;
- headers: every ``Pgw-*``, ``Nats-*`` and ``traceparent`` string literal;
- permissions: the block rendered by ``gateway.security.contract_table``.

Read from the document: the first column of the tables of §2 (subjects),
§4 (streams), §5 (buckets) and §6 (headers), the builders named in §2, every
``pgw schema NAME``, and the generated block of §8.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib
import re
import typing
from pathlib import Path

from gateway.security import contract_table
from pgwcore import streams
from subjects import names
from subjects.names import Subjects
from subjects.schemas import all_types

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "contract.md"
NOT_CODE = {"tests", "benchmarks"}
# Its allow/deny lists are §8's generated block, checked verbatim by the first test.
PERMISSIONS = ROOT / "gateway" / "security" / "permissions.py"
HEADER_RE = re.compile(r"^(Pgw-[A-Za-z][A-Za-z0-9-]*|Nats-[A-Za-z][A-Za-z0-9-]*|traceparent)$")
SAMPLE = "SAMPLEx9"  # a valid token standing for any one token


# -- the document -------------------------------------------------------------

def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def doc_section(number: int) -> str:
    m = re.search(rf"^## {number}\. .*?(?=^## |\Z)", doc_text(), re.M | re.S)
    assert m, f"docs/contract.md has no section '## {number}.'"
    return m.group(0)


def doc_rows(number: int) -> list[list[str]]:
    """The cells of the first table of section ``number`` (header and rule left out)."""
    rows = [ln for ln in doc_section(number).splitlines() if ln.startswith("|")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", ln)[1:-1]] for ln in rows[2:]]


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def doc_names(number: int) -> set[str]:
    return {ticked(row[0])[0] for row in doc_rows(number)}


# -- the code -----------------------------------------------------------------

@functools.cache
def code_files() -> tuple[tuple[Path, ast.Module], ...]:
    """Every module of the repository's packages but the tests and the benchmarks, parsed."""
    return tuple(
        (path, ast.parse(path.read_text(encoding="utf-8"), str(path)))
        for pkg in sorted(p.parent for p in ROOT.glob("*/__init__.py"))
        if pkg.name not in NOT_CODE and not pkg.name.startswith(".")
        for path in sorted(pkg.rglob("*.py"))
    )


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def resolve(node: ast.expr, path: Path) -> str | None:
    """A string constant, or a module-level name of the module (None when neither)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        value = getattr(importlib.import_module(module_of(path)), node.id, None)
        return value if isinstance(value, str) else None
    if isinstance(node, ast.Attribute) and isinstance(getattr(Subjects, node.attr, None), property):
        return getattr(Subjects(), node.attr)
    return None


def is_prefix(node: ast.expr) -> bool:
    src = ast.unparse(node)
    return src.split(".")[-1] in ("prefix", "p") and "api" not in src


def template(node: ast.JoinedStr) -> str | None:
    """``f"{prefix}.agent.{a}.x"`` as ``agent.*.x``; None for an f-string not rooted at the prefix."""
    v = node.values
    if len(v) < 2 or not isinstance(v[0], ast.FormattedValue) or not is_prefix(v[0].value):
        return None
    if not (isinstance(v[1], ast.Constant) and str(v[1].value).startswith(".")):
        return None
    return "".join(str(x.value) if isinstance(x, ast.Constant) else "*" for x in v[1:])[1:]


def code_templates() -> dict[str, str]:
    """Every ``{prefix}.…`` f-string outside ``subjects/`` and the permission builders: {template: where}.

    ``subjects/`` is read by introspection instead (:func:`subjects_builders`), which
    names each channel a generic builder such as ``Subjects.agent`` takes.
    """
    out: dict[str, str] = {}
    for path, tree in code_files():
        if path == PERMISSIONS or path.parent == ROOT / "subjects":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr) and (t := template(node)):
                out.setdefault(t, f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def subjects_builders() -> dict[str, list[str]]:
    """Every subject builder of ``subjects/`` and the subjects it makes: {"Subjects.x": [...], "mod.f": [...]}."""
    s = Subjects()
    out: dict[str, list[str]] = {}
    for name, attr in vars(Subjects).items():
        if name.startswith("_") or name == "parse":
            continue
        if isinstance(attr, property):
            out[f"Subjects.{name}"] = [getattr(s, name)]
        elif callable(attr):
            hints = typing.get_type_hints(attr, vars(names))
            choices = []
            for param in list(typing.get_type_hints(attr, vars(names)))[:-1]:  # the last hint is the return
                if typing.get_origin(hints[param]) is typing.Literal:
                    choices.append(typing.get_args(hints[param]))
                elif param == "verdict_class":
                    choices.append(names.VERDICT_CLASSES)
                else:
                    choices.append((SAMPLE if param != "event" else "SAMPLE_EVENT",))
            combos: list[tuple[str, ...]] = [()]
            for c in choices:
                combos = [(*prev, x) for prev in combos for x in c]
            out[f"Subjects.{name}"] = [getattr(s, name)(*args) for args in combos]
    for path in sorted((ROOT / "subjects").glob("*.py")):
        mod = importlib.import_module(module_of(path))
        for fn in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(fn, ast.FunctionDef) and any(
                isinstance(r, ast.Return) and isinstance(r.value, ast.JoinedStr) and template(r.value)
                for r in ast.walk(fn)
            ):
                args = ["pgw"] + [SAMPLE] * (len(fn.args.args) - 1)
                out[f"{path.stem}.{fn.name}"] = [getattr(mod, fn.name)(*args)]
    return out


def relative(subject: str) -> str:
    if subject.startswith("$KV."):  # a stream laid out as a bucket (KV_PGW_ANSWER_TEXT): outside the prefix
        return subject
    assert subject.startswith("pgw."), subject
    return subject[4:].replace(SAMPLE, "*").replace("SAMPLE_EVENT", "*")


def overlaps(a: str, b: str) -> bool:
    """Whether two patterns can name one subject (``*`` or ``{x}`` one token, ``>`` the rest)."""
    ta, tb = a.split("."), b.split(".")
    for x, y in zip(ta, tb, strict=False):
        if ">" in (x, y):
            return True
        wild = x == "*" or y == "*" or x.startswith("{") or y.startswith("{")
        if not wild and x != y:
            return False
    return len(ta) == len(tb)


def code_streams() -> dict[str, list[str]]:
    """Every stream the code creates: {name: its subjects relative to the prefix}."""
    out = {p.name: [relative(s) for s in p.config.subjects] for p in streams.stream_plans(Subjects())}
    for path, tree in code_files():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "StreamConfig":
                kw = {k.arg: k.value for k in node.keywords}
                name = resolve(kw["name"], path) if "name" in kw else None
                if name is None:
                    continue
                subs = []
                for el in getattr(kw.get("subjects"), "elts", []):
                    t = template(el) if isinstance(el, ast.JoinedStr) else resolve(el, path)
                    subs.append(t if isinstance(el, ast.JoinedStr) else relative(t or "pgw.?"))
                out.setdefault(name, subs)
    return out


def code_buckets() -> set[str]:
    """Every KV bucket the code creates."""
    from subjects.gate import exec_bucket

    out = set(streams.KV_BUCKETS)
    # One per executor kind (subjects/executor.py), named by this function: listed as its template.
    if exec_bucket("kind") == "PGW_EXEC_KIND":
        out.add("PGW_EXEC_{KIND}")
    for path, tree in code_files():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            fname = ast.unparse(node.func).split(".")[-1]
            if fname == "ensure_kv" and len(node.args) >= 2:
                arg: ast.expr | None = node.args[1]
            elif fname in ("KeyValueConfig", "create_key_value"):
                arg = next((k.value for k in node.keywords if k.arg == "bucket"), None)
            else:
                continue
            if arg is not None and (name := resolve(arg, path)):
                out.add(name)
    return out


def code_headers() -> dict[str, str]:
    out: dict[str, str] = {}
    for path, tree in code_files():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and HEADER_RE.match(node.value):
                out.setdefault(node.value, f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def missing(what: str, names_: object) -> str:
    return f"{what}:\n  " + "\n  ".join(sorted(map(str, names_)))  # type: ignore[call-overload]


# -- the tests ----------------------------------------------------------------

def test_permission_block_is_rendered_from_the_builders():
    """§8 of docs/contract.md is exactly what gateway.security.contract_table renders from the permission builders."""
    have = contract_table.block(doc_text())
    assert have is not None, f"docs/contract.md lacks the markers {contract_table.BEGIN!r} / {contract_table.END!r}"
    want = contract_table.render()
    diff = "".join(difflib.unified_diff(have.splitlines(True), want.splitlines(True), "docs/contract.md", "rendered"))
    assert have == want, (
        "the permission table of docs/contract.md is stale; regenerate it with\n"
        "  python -m gateway.security.contract_table --write\n" + diff
    )


def test_every_role_and_service_is_in_the_permission_block():
    """Each role of ROLE_BUILDERS and each service name has its row in the document."""
    block = contract_table.block(doc_text()) or ""
    parties = [party for _role, party, _p in contract_table.parties()]
    assert {role for role, _party, _p in contract_table.parties()} == set(contract_table.ROLE_BUILDERS)
    assert {"gateway", "signer", "registrar", "notifier"} <= set(contract_table.service_names())
    absent = [p for p in parties if f"| `{p}` |" not in block]
    assert not absent, missing("parties without a row in docs/contract.md §8", absent)


def test_every_subject_builder_is_documented():
    """Every subject builder in subjects/ is named in §2, and each subject it makes matches a documented subject."""
    builders = subjects_builders()
    section = doc_section(2)
    named = set(re.findall(r"`(\w+\.\w+)`", section))
    absent = sorted(b for b in builders if b not in named)
    assert not absent, missing("subject builders of subjects/ not named in docs/contract.md §2", absent)
    documented = [ticked(row[0])[0] for row in doc_rows(2)]
    unmatched = sorted(
        f"{b} -> {relative(s)}" for b, made in builders.items() for s in made
        if not any(overlaps(relative(s), d) for d in documented)
    )
    assert not unmatched, missing("subjects made by builders that no row of docs/contract.md §2 lists", unmatched)


def test_every_builder_the_document_names_exists():
    """Every `Subjects.x` / `module.function` builder named in §2 exists in subjects/."""
    builders = subjects_builders()
    cells = [row[1] for row in doc_rows(2)]
    named = {n for c in cells for n in ticked(c) if re.fullmatch(r"\w+\.\w+", n)}
    ghosts = sorted(named - set(builders))
    assert not ghosts, missing("builders named in docs/contract.md §2 that subjects/ lacks", ghosts)


def test_every_subject_in_the_code_is_documented():
    """Every `{prefix}.…` subject the code builds anywhere matches a subject listed in §2."""
    documented = [ticked(row[0])[0] for row in doc_rows(2)]
    absent = sorted(f"{t}  ({where})" for t, where in code_templates().items()
                    if not any(overlaps(t, d) for d in documented))
    assert not absent, missing("subjects built in the code that docs/contract.md §2 lacks", absent)


def test_every_documented_subject_exists_in_the_code():
    """Every subject listed in §2 is made by a builder or an f-string of the code."""
    made = [relative(s) for ss in subjects_builders().values() for s in ss] + list(code_templates())
    ghosts = sorted(d for d in (ticked(row[0])[0] for row in doc_rows(2))
                    if not any(overlaps(d, m) for m in made))
    assert not ghosts, missing("subjects in docs/contract.md §2 that no code builds", ghosts)


def test_streams_match_the_code():
    """The streams of §4 are exactly the streams the code creates, each with the subjects it has."""
    code, doc = code_streams(), doc_names(4)
    assert not set(code) - doc, missing("streams the code creates that docs/contract.md §4 lacks", set(code) - doc)
    assert not doc - set(code), missing("streams in docs/contract.md §4 that the code never creates", doc - set(code))
    wrong = []
    for row in doc_rows(4):
        name, subs = ticked(row[0])[0], ticked(row[1])
        if sorted(subs) != sorted(code[name]) and not all(any(overlaps(s, c) for c in code[name]) for s in subs):
            wrong.append(f"{name}: document {subs}, code {code[name]}")
    assert not wrong, missing("streams whose subjects in docs/contract.md §4 differ from the code", wrong)


def test_stream_properties_match_the_plans():
    """For the streams of pgwcore.streams, §4 states the retention, age limit and deny-delete/purge the plan sets."""
    rows = {ticked(row[0])[0]: row for row in doc_rows(4)}
    plans = streams.stream_plans(Subjects())
    # The page says "the first eight are stream_plans": keep them first, in the plans' order.
    assert list(rows)[: len(plans)] == [p.name for p in plans], "docs/contract.md §4 must list stream_plans first, in order"
    wrong = []
    for plan in plans:
        row = rows[plan.name]
        work_queue = plan.config.retention == streams.RetentionPolicy.WORK_QUEUE
        if work_queue != row[2].startswith("work queue"):
            wrong.append(f"{plan.name}: retention {plan.config.retention}")
        age = plan.config.max_age
        said = (f"{age / 86400:g} days",) if age else ("kept forever", "no age limit")
        if not any(s in row[2] for s in said):
            wrong.append(f"{plan.name}: max_age {age}")
        if bool(plan.config.deny_delete and plan.config.deny_purge) != (row[4] == "deny delete and purge"):
            wrong.append(f"{plan.name}: deny_delete={plan.config.deny_delete} deny_purge={plan.config.deny_purge}")
    assert not wrong, missing("stream properties docs/contract.md §4 misstates", wrong)


def test_buckets_match_the_code():
    """The KV buckets of §5 are exactly the buckets the code creates."""
    code, doc = code_buckets(), doc_names(5)
    assert not code - doc, missing("KV buckets the code creates that docs/contract.md §5 lacks", code - doc)
    assert not doc - code, missing("KV buckets in docs/contract.md §5 that the code never creates", doc - code)


def test_headers_match_the_code():
    """The headers of §6 are exactly the Pgw-*, Nats-* and traceparent headers the code names."""
    code, doc = code_headers(), doc_names(6)
    absent = sorted(f"{h}  ({where})" for h, where in code.items() if h not in doc)
    assert not absent, missing("headers in the code that docs/contract.md §6 lacks", absent)
    assert not doc - set(code), missing("headers in docs/contract.md §6 that no code names", doc - set(code))


def test_every_wire_type_is_linked_and_every_link_exists():
    """Every wire type `pgw schema` knows is linked in the document, and every `pgw schema NAME` there exists."""
    linked = set(re.findall(r"pgw schema (?!NAME\b)(\w+)", doc_text()))
    types = set(all_types())
    assert not types - linked, missing("wire types docs/contract.md never links as `pgw schema NAME`", types - linked)
    assert not linked - types, missing("`pgw schema NAME` in docs/contract.md that is no wire type", linked - types)


def test_overlaps_is_token_wise():
    """The pattern matcher the checks rely on tells one token from another and honours `>`."""
    assert overlaps("agent.{agent}.envelope", "agent.*.envelope")
    assert overlaps("log.{event}", "log.>")
    assert not overlaps("agent.{agent}.envelope", "agent.*.outcome")
    assert not overlaps("agent.{agent}", "agent.*.envelope")
    assert not overlaps("kernel.audit.{auditor}", "kernel.revoke")
