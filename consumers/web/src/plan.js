// The render model of consumers/surfaces/model.py, for the browser.
//
// planItem(item) turns one surface item (parsed JSON) into a render plan that
// already honours spec 000 §9.1 (all four briefing slots, every option with
// its reasoning, exactly one recommended option, one entry per open hatch),
// falls back to the notice form for anything it cannot plan as a whole
// (spec 000 §9.3, §12.5), and renders authorization envelopes per variant
// with an unknown kind or refusal code BLOCKED (spec 001 "Client Requirement"). It never
// throws. tests/test_surface_web.py compares it with the Python model on one
// corpus of items, so the two surfaces cannot drift apart.

export const MAX_VALUE_CHARS = 4000;

export const HATCH_TEXT = {
  free_text: ["Answer in my own words", "Accept the question, but answer it yourself."],
  dialogue: ["Reject the question", "The question itself is wrong or premature; reopen deliberation."],
};

const AUTHORITATIVE = ["measurement", "classification", "action"];
const REFUSAL_CODES = ["BLOCKED", "UNRESOLVABLE", "POLICY_VIOLATION", "EMERGENCY_ESCALATION"]; // spec 001 RefusalReason
const HEX_ID = /^[0-9a-f]{16,64}$/;
const TOKEN = /^[A-Za-z0-9_-]{1,64}$/;

class Malformed extends Error {}

const isObj = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
const isStr = (v) => typeof v === "string";
const isInt = (v) => Number.isInteger(v);

function need(cond, why) {
  if (!cond) throw new Malformed(why);
}

function str(obj, key, { min = 1, max = 2000, optional = false } = {}) {
  const v = obj[key];
  if (v === undefined || v === null) {
    need(optional, `missing ${key}`);
    return null;
  }
  need(isStr(v), `${key} is not a string`);
  need([...v].length >= min && [...v].length <= max, `${key} has a bad length`);
  return v;
}

function closed(obj, allowed, what) {
  for (const k of Object.keys(obj)) need(allowed.includes(k), `unknown member ${k} in ${what}`);
}

function sortedJson(v) {
  if (Array.isArray(v)) return "[" + v.map(sortedJson).join(",") + "]";
  if (isObj(v)) {
    return "{" + Object.keys(v).sort().map((k) => JSON.stringify(k) + ":" + sortedJson(v[k])).join(",") + "}";
  }
  return JSON.stringify(v === undefined ? null : v);
}

export function valueText(v) {
  let text = isStr(v) ? v : sortedJson(v);
  if (text.length > MAX_VALUE_CHARS) text = text.slice(0, MAX_VALUE_CHARS) + "… (truncated)";
  return text;
}

function base(item) {
  need(isStr(item.agent) && TOKEN.test(item.agent), "bad agent");
  need(isStr(item.principal) && TOKEN.test(item.principal), "bad principal");
  str(item, "created_at", { max: 64 });
  need(item.untrusted === undefined || typeof item.untrusted === "boolean", "bad untrusted");
  return { agent: item.agent, created_at: item.created_at, untrusted: item.untrusted === true };
}

function hexId(item, key) {
  need(isStr(item[key]) && HEX_ID.test(item[key]), `bad ${key}`);
  return item[key];
}

function notice(b, itemId, diagnostic, conventional) {
  return {
    plan: "notice",
    ...b,
    item_id: itemId,
    diagnostic,
    conventional: conventional === null || conventional === undefined ? null : valueText(conventional),
  };
}

function decision(item, b) {
  const momentId = hexId(item, "moment_id");
  str(item, "envelope_id", { max: 128 });
  str(item, "correlation_id", { max: 128 });
  const expires = str(item, "expires_at", { max: 64, optional: true });
  need(item.hem === undefined || typeof item.hem === "boolean", "bad hem");
  const bm = item.binding_moment;
  need(isObj(bm), "binding_moment is not an object");
  closed(bm, ["synopsis", "findings", "recommendations", "offer", "question", "meta"], "binding_moment");
  const synopsis = str(bm, "synopsis");
  const offer = str(bm, "offer");
  for (const k of ["findings", "recommendations"]) {
    need(Array.isArray(bm[k]) && bm[k].length <= 32, `${k} is not a list`);
    bm[k].forEach((_, i) => str(bm[k], i));
  }
  const q = bm.question;
  need(isObj(q), "question is not an object");
  closed(q, ["stem", "options", "recommended_idx", "hatches"], "question");
  const stem = str(q, "stem");
  need(Array.isArray(q.options), "options is not a list");
  need(q.options.length >= 2 && q.options.length <= 4, `${q.options.length} options; a binding moment has 2 to 4`);
  const options = q.options.map((o, i) => {
    need(isObj(o), "option is not an object");
    closed(o, ["label", "reasoning"], "option");
    return { index: i, label: str(o, "label", { max: 200 }), reasoning: str(o, "reasoning", { max: 1000 }) };
  });
  need(isInt(q.recommended_idx) && q.recommended_idx >= 0, "recommended_idx is not a non-negative integer");
  const h = q.hatches;
  need(isObj(h), "hatches is not an object");
  closed(h, ["free_text", "dialogue"], "hatches");
  need(typeof h.free_text === "boolean" && typeof h.dialogue === "boolean", "hatches are not both booleans");
  let meta = { decision_class: null, calibration_note: null };
  if (bm.meta !== undefined && bm.meta !== null) {
    need(isObj(bm.meta), "meta is not an object");
    closed(bm.meta, ["decision_class", "calibration_note"], "meta");
    meta = {
      decision_class: str(bm.meta, "decision_class", { max: 128, optional: true }),
      calibration_note: str(bm.meta, "calibration_note", { max: 1000, optional: true }),
    };
  }
  // spec 000 §5 / §12.5: out of range is malformed; discard, never repair.
  if (q.recommended_idx >= options.length) {
    return notice(
      b,
      momentId,
      `Malformed binding moment discarded: recommended_idx ${q.recommended_idx} is not an index of its ${options.length} options (spec 000 §5, §12.5).`,
      null,
    );
  }
  if (!synopsis.trim() || !offer.trim() || !stem.trim()) {
    return notice(b, momentId, "Malformed binding moment discarded: an empty briefing or question slot (spec 000 §5, §12.5).", null);
  }
  const hatches = [];
  for (const kind of ["free_text", "dialogue"]) {
    if (h[kind]) hatches.push({ kind, label: HATCH_TEXT[kind][0], hint: HATCH_TEXT[kind][1] });
  }
  return {
    plan: "decision",
    ...b,
    moment_id: momentId,
    expires_at: expires,
    hem: item.hem === true,
    synopsis,
    findings: [...bm.findings],
    recommendations: [...bm.recommendations],
    offer,
    stem,
    options: options.map((o) => ({ ...o, recommended: o.index === q.recommended_idx })),
    recommended_idx: q.recommended_idx,
    hatches,
    decision_class: meta.decision_class,
    calibration_note: meta.calibration_note,
    // Who recommends: the agent that wrote the moment, or on a gateway-made one (hem) the gateway's policy.
    recommended_by: item.hem === true ? "gateway" : "agent",
    // A gateway-made moment's arguments, whole (gateway/kernel/hem.py attachment), shown on request.
    attachments: item.hem === true ? attachments(item.conventional) : [],
  };
}

function attachments(conventional) {
  const args = isObj(conventional) ? conventional.arguments : undefined;
  if (!Array.isArray(args)) return [];
  const out = args
    .filter((a) => isObj(a) && isStr(a.name) && isStr(a.text))
    .map((a) => ({ name: a.name, text: a.text, chars: [...a.text].length }));
  return out.length === args.length ? out : [];
}

function clarification(item, b) {
  const momentId = hexId(item, "moment_id");
  str(item, "envelope_id", { max: 128 });
  str(item, "correlation_id", { max: 128 });
  need(Array.isArray(item.questions), "questions is not a list");
  const questions = item.questions.map((q) => {
    need(isObj(q), "question is not an object");
    return { id: str(q, "id", { max: 128 }), question: str(q, "question") };
  });
  return {
    plan: "clarification",
    ...b,
    moment_id: momentId,
    expires_at: str(item, "expires_at", { max: 64, optional: true }),
    context_type: isStr(item.context_type) ? item.context_type : null,
    questions,
  };
}

function authorization(item, b) {
  const itemId = hexId(item, "item_id");
  str(item, "envelope_id", { max: 128 });
  need(isStr(item.workflow_id), "bad workflow_id");
  need(isObj(item.envelope), "envelope is not an object");
  const env = item.envelope;
  const kind = env.kind;
  const variant = isStr(kind) ? kind : "(none)";
  const fields = [];
  const shown = (title) => ({
    plan: "authorization", ...b, item_id: itemId, workflow_id: item.workflow_id,
    variant, status: "shown", title, fields,
  });
  const blocked = (why) => ({
    plan: "authorization", ...b, item_id: itemId, workflow_id: item.workflow_id,
    variant, status: "BLOCKED", title: "BLOCKED", fields: [{ label: "Why", value: why }],
  });
  const F = (label, value) => fields.push({ label, value });
  if (AUTHORITATIVE.includes(kind)) {
    const prov = env.provenance;
    const records = isObj(prov) ? prov.oracle_records : undefined;
    if (!Array.isArray(records) || records.length === 0) return blocked(`${kind} without oracle provenance (spec 001)`);
    let title;
    if (kind === "measurement") {
      if (typeof env.value !== "number") return blocked("measurement without a numeric value");
      F("Value", valueText(env.value));
      title = "Measurement";
    } else if (kind === "classification") {
      if (!isStr(env.label)) return blocked("classification without a label");
      F("Label", env.label);
      title = "Classification";
    } else {
      if (!isStr(env.action)) return blocked("action without an action name");
      F("Action", env.action);
      if (env.params !== undefined && env.params !== null) F("Parameters", valueText(env.params));
      title = "Action";
    }
    F("Oracle records", String(records.length));
    if (isStr(prov.generated_at)) F("Generated at", prov.generated_at);
    if (isStr(prov.envelope_id)) F("Envelope", prov.envelope_id);
    return shown(title);
  }
  if (kind === "narrative") {
    if (!isStr(env.text)) return blocked("narrative without text");
    F("Text", env.text);
    if (isObj(env.policy) && isStr(env.policy.grammar_mode)) F("Grammar mode", env.policy.grammar_mode);
    return shown("Narrative (not authoritative)");
  }
  if (kind === "refusal") {
    const r = env.reason;
    if (!isObj(r) || !isStr(r.code)) return blocked("refusal without a reason code");
    // spec 001 RefusalReason: four codes; anything else fails closed like an unknown kind.
    if (!REFUSAL_CODES.includes(r.code)) return blocked("refusal with an unknown code: blocked (fail closed, spec 001)");
    F("Code", r.code);
    if (isStr(r.user_message)) F("Message", r.user_message);
    if (isStr(r.recovery_hint)) F("What you can do", r.recovery_hint);
    if (isStr(r.audit_id)) F("Reference", r.audit_id);
    return shown("Refused");
  }
  if (kind === "dispute_summary") {
    if (!Array.isArray(env.sources)) return blocked("dispute summary without sources");
    for (const src of env.sources) {
      if (!isObj(src)) continue;
      const oracles = Array.isArray(src.oracles) ? src.oracles : [];
      const parts = oracles
        .filter(isObj)
        .map((o) => `${o.oracle_id ?? "?"} (${o.tier ?? "?"}): ${valueText(o.value ?? null)}`);
      const note = src.escalation_required === true ? " — escalation required" : "";
      F(`Axis ${valueText(src.axis ?? "?")}`, parts.join("; ") + note);
    }
    return shown("Oracles disagree");
  }
  // spec 001: "Clients MUST treat unknown kind values as BLOCKED (fail closed)".
  return blocked(`unknown authorization kind '${variant}': blocked (fail closed, spec 001)`);
}

export function planItem(input) {
  let item = input;
  if (typeof input === "string") {
    try {
      item = JSON.parse(input);
    } catch (e) {
      return notice({ agent: "unknown agent", created_at: "", untrusted: false }, "",
        `This unknown item could not be shown as a decision and was discarded (${e.message}).`, input);
    }
  }
  const raw = isObj(item) ? item : {};
  const s = (k) => (isStr(raw[k]) ? raw[k] : "");
  try {
    need(isObj(item), "not an object");
    const b = base(item);
    switch (item.item) {
      case "binding_moment":
        return decision(item, b);
      case "clarification":
        return clarification(item, b);
      case "authorization":
        return authorization(item, b);
      case "notice":
        hexId(item, "item_id");
        need(isStr(item.envelope_id) && isStr(item.diagnostic), "bad notice");
        return notice(b, item.item_id, item.diagnostic, item.conventional);
      case "withdrawn":
        need(["resolved", "expired", "superseded"].includes(item.reason), "bad reason");
        return { plan: "withdraw", ...b, moment_id: hexId(item, "moment_id"), reason: item.reason };
      default:
        throw new Malformed(`unknown item type ${JSON.stringify(item.item)}`);
    }
  } catch (e) {
    const why = e instanceof Malformed ? e.message : `${e.name}: ${e.message}`;
    return notice(
      { agent: s("agent") || "unknown agent", created_at: s("created_at"), untrusted: raw.untrusted === true },
      s("moment_id") || s("item_id"),
      `This ${s("item") || "unknown"} item could not be shown as a decision and was discarded (${why}).`,
      raw.conventional ?? null,
    );
  }
}
