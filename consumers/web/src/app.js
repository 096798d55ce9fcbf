// The browser surface of Principal Gateway (DESIGN §4, spec 000 §9).
//
// Connects straight to NATS over the server's WebSocket listener with the
// principal's own credentials (@nats-io/nats-core wsconnect), subscribes to
// principal.{P}.surface, asks principal.{P}.pending for what is still waiting,
// answers on principal.{P}.resolve and shows the gateway's reply; lists and
// revokes her standing approvals on kernel.approvals.{P}. Every item
// goes through planItem (plan.js) first; only plans are rendered, and only
// with textContent, never as HTML.
//
// Accessibility (WCAG 2.2 AA, docs/surfaces.md "Accessibility"): focus is
// never left to fall to the page (an answer moves it to the card's reply line,
// a card that goes hands it to the next card's heading, a closed panel gives
// it back to its button); what changes without the principal's doing is told
// in a live region (a new moment in #announce, the count in #count, a moment
// gone elsewhere in the Activity log); deadlines name their time zone.

import {
  credsAuthenticator,
  nkeyAuthenticator,
  wsconnect,
} from "@nats-io/nats-core";
import { fmtTime, h, put } from "./dom.js";
import { planItem } from "./plan.js";
import { Reach } from "./notify.js";
import { loadConfig, registerServiceWorker } from "./shell.js";

window.pgwPlan = planItem; // for the cross-model test, and for curious principals

const enc = new TextEncoder();
const dec = new TextDecoder();

const REFUSALS = {
  already_resolved: "This moment was already answered, on another device or surface.",
  expired: "This moment expired before your answer arrived.",
  unknown_moment: "The gateway does not know this moment.",
  hatch_closed: "That hatch is closed for this moment.",
  index_out_of_range: "No such option.",
  untrusted_content_blocks_approval: "Untrusted content cannot approve the action it gates.",
};
const GONE = new Set(["already_resolved", "expired", "unknown_moment"]);

// ---------------------------------------------------------------------------
// State
// ---------------------------------------------------------------------------

const state = {
  nc: null,
  subjects: null,
  cards: new Map(), // key -> {plan, el}
  seen: new Set(),
  closed: new Set(),
  answeredHere: new Set(),
  inFlight: new Set(), // moments this tab is answering: their reply is shown before the card goes
  loaded: false, // the first pending list is in: later new cards may notify (notify.js)
  reach: null, // notifications, push subscription, presence (notify.js)
  timeZone: undefined, // the principal's configured IANA zone; undefined: the browser's
  title: document.title,
};

// How long an answered card stays, its confirmation showing (a test holds it longer to check it).
const answeredHoldMs = () => (Number.isFinite(window.pgwAnsweredHoldMs) ? window.pgwAnsweredHoldMs : 2500);

const $list = () => document.getElementById("items");
const $empty = () => document.getElementById("empty");
const $activity = () => document.getElementById("activity");

function setConn(status, text) {
  const el = document.getElementById("conn");
  el.dataset.status = status;
  el.querySelector(".conn-text").textContent = text;
}

// The Activity list is a log (role=log, polite): each entry is read out as it is added.
// Appended, not prepended: a log's new entries go at its end.
function logActivity(text, kind = "info") {
  const li = h("li", { class: `activity-${kind}` }, h("time", { text: new Date().toLocaleTimeString() }), " ", text);
  $activity().append(li);
  document.getElementById("activity-section").classList.remove("is-empty");
}

// A polite status message with no visible place of its own (WCAG 4.1.3).
function announce(text) {
  document.getElementById("announce").textContent = text;
}

// Until the first pending list has answered the page does not know: it says it is connecting
// (index.html), never that nothing is waiting.
const NOTHING_WAITING = "Nothing is waiting for you. New questions from your agents appear here as they arrive.";

function updateEmpty() {
  const n = state.cards.size;
  const empty = $empty();
  empty.hidden = n > 0;
  if (state.loaded && empty.dataset.state !== "loaded") {
    empty.dataset.state = "loaded";
    empty.textContent = NOTHING_WAITING;
  }
  if (state.loaded || n > 0) document.getElementById("count").textContent = n === 1 ? "1 item waiting" : `${n} items waiting`;
  document.title = n > 0 ? `(${n}) ${state.title}` : state.title;
}

const KIND_WORD = { decision: "decision", clarification: "question", authorization: "authorization", notice: "notice" };

function keyOf(item) {
  if (!item || typeof item !== "object") return null;
  const id = item.moment_id || item.item_id;
  return typeof id === "string" && typeof item.item === "string" ? [item.item, id] : null;
}

// Each item once; never resurrect a moment already withdrawn (DESIGN §4.1).
function fresh(item) {
  const k = keyOf(item);
  if (!k) return true;
  const s = k.join("\u0000");
  if (state.seen.has(s)) return false;
  state.seen.add(s);
  if (k[0] === "withdrawn") {
    state.closed.add(k[1]);
    return true;
  }
  return !state.closed.has(k[1]);
}

function accept(item) {
  if (!fresh(item)) return;
  const plan = planItem(item);
  if (plan.plan === "withdraw") {
    const card = state.cards.get(plan.moment_id);
    state.reach?.withdrawn(plan.moment_id);
    if (card && state.inFlight.has(plan.moment_id)) {
      card.withdrawn = plan.reason; // resolve() shows this tab's reply, then removes the card
    } else if (card) {
      removeCard(plan.moment_id);
      if (!state.answeredHere.has(plan.moment_id)) {
        const what = card.plan.synopsis || "a moment";
        const why = plan.reason === "resolved" ? "was answered on another device" : plan.reason === "expired" ? "expired unanswered" : "was withdrawn by the agent";
        logActivity(`“${what}” ${why}.`, "withdrawn");
      }
    }
    return;
  }
  const key = plan.moment_id || plan.item_id || `anon-${state.seen.size}-${Math.random()}`;
  if (state.cards.has(key)) return;
  const el = renderPlan(plan, key);
  state.cards.set(key, { plan, el });
  $list().append(el);
  updateEmpty();
  if (state.loaded) {
    const what = plan.synopsis || plan.title || "";
    announce(`New ${KIND_WORD[plan.plan] || "item"} from agent ${plan.agent}${what ? `: ${what}` : "."}`);
    state.reach?.arrived(plan);
  }
}

// A card that holds the focus hands it on before it goes (WCAG 2.4.3): to the
// next card's heading, else the previous one's, else the list's heading.
function handFocusOn(el) {
  if (!el.contains(document.activeElement)) return;
  const next = el.nextElementSibling || el.previousElementSibling;
  const target = next?.querySelector(".synopsis") || document.getElementById("list-title");
  target.focus();
}

function removeCard(key) {
  const card = state.cards.get(key);
  if (!card) return;
  state.cards.delete(key);
  handFocusOn(card.el);
  card.el.remove();
  updateEmpty();
}

// ---------------------------------------------------------------------------
// Rendering (spec 000 §9.1 invariants; the plan already enforces them)
// ---------------------------------------------------------------------------

function cardHeader(plan, label) {
  return h(
    "header",
    { class: "card-head" },
    h("span", { class: "kind", text: label }),
    h("span", { class: "agent" }, "from agent ", h("strong", { text: plan.agent })),
    plan.created_at ? h("time", { class: "when", datetime: plan.created_at, text: fmtTime(plan.created_at, state.timeZone) }) : null,
  );
}

function untrustedBanner(plan) {
  if (!plan.untrusted) return null;
  return h(
    "div",
    { class: "banner banner-untrusted", role: "note" },
    h("strong", { text: "Untrusted content. " }),
    "This was built from content the gateway marked untrusted. Check it before you rely on it; it cannot approve an action on its own.",
  );
}

// The reply line: a polite status, and where focus goes once the principal answers.
function replyBox() {
  return h("div", { class: "reply", role: "status", "aria-live": "polite", tabindex: "-1" });
}

function expiryChip(plan) {
  if (!plan.expires_at) return null;
  return h("span", { class: "chip chip-expiry" }, "Answer by ", h("time", { datetime: plan.expires_at, text: fmtTime(plan.expires_at, state.timeZone) }));
}

function showReply(card, ok, text) {
  const box = card.querySelector(".reply");
  box.className = `reply ${ok ? "reply-ok" : "reply-refused"}`;
  box.textContent = text;
}

async function resolve(key, resolution, card, what) {
  const buttons = card.querySelectorAll("button, input, textarea");
  showReply(card, true, "Sending your answer…");
  // Focus first, then disable: a disabled control that held the focus drops it to the page.
  card.querySelector(".reply").focus();
  buttons.forEach((b) => (b.disabled = true));
  state.inFlight.add(key);
  let reply;
  try {
    const msg = await state.nc.request(
      state.subjects.resolve,
      enc.encode(JSON.stringify({ moment_id: key, resolution })),
      { timeout: 10000 },
    );
    reply = JSON.parse(dec.decode(msg.data));
  } catch (e) {
    reply = { status: "refused", code: "unreachable", reason: `The gateway did not answer (${e.message}). Nothing was recorded; try again.` };
  }
  state.inFlight.delete(key);
  const withdrawn = state.cards.get(key)?.withdrawn;
  if (reply.status === "accepted") {
    state.answeredHere.add(key);
    card.classList.add("answered");
    showReply(card, true, `Accepted: ${what}. The agent has your answer.`);
    logActivity(`You answered “${state.cards.get(key)?.plan.synopsis || "a question"}”: ${what}.`, "ok");
    setTimeout(() => removeCard(key), answeredHoldMs());
  } else {
    const text = REFUSALS[reply.code] || reply.reason || "Refused.";
    showReply(card, false, `Not accepted — ${text}${reply.code ? ` (${reply.code})` : ""}`);
    if (GONE.has(reply.code) || withdrawn) {
      card.classList.add("answered");
      setTimeout(() => removeCard(key), 4000);
    } else {
      buttons.forEach((b) => (b.disabled = false));
      card.dispatchEvent(new Event("pgw-reenable"));
    }
  }
}

// Who recommends: the agent that wrote the moment, or on a gateway-made one the gateway's policy.
const RECOMMENDER = { agent: "Recommended by the agent", gateway: "Recommended by the gateway's policy" };

// A gateway-made moment's arguments, whole, on request: never silently clipped (docs/gate.md).
function wholeArguments(plan) {
  if (!plan.attachments.length) return null;
  const chars = plan.attachments.reduce((n, a) => n + a.chars, 0);
  return h(
    "details",
    { class: "whole-args" },
    h("summary", { text: `Show the arguments in full (${chars.toLocaleString("en")} characters)` }),
    h("dl", {}, plan.attachments.map((a) => [
      h("dt", { text: `${a.name} (${a.chars.toLocaleString("en")} characters)` }),
      h("dd", {}, h("pre", { class: "whole-text", text: a.text })),
    ])),
  );
}

function renderDecision(plan, key) {
  const card = h("article", {
    class: `card card-decision${plan.untrusted ? " is-untrusted" : ""}`,
    "data-moment-id": plan.moment_id,
    "aria-labelledby": `syn-${key}`,
  });
  const meta = h(
    "div",
    { class: "meta" },
    plan.hem ? h("span", { class: "chip chip-hem", text: "Approval before action" }) : null,
    // A gateway-made moment's class (idp.hem) is for the record, not for the principal.
    plan.decision_class && plan.recommended_by === "agent" ? h("span", { class: "chip", text: plan.decision_class }) : null,
    expiryChip(plan),
  );
  // Plain sections, not named regions: one landmark per card would repeat on every card.
  const briefing = h(
    "section",
    { class: "briefing" },
    plan.calibration_note ? h("p", { class: "calibration" }, h("strong", { text: "Note from the agent: " }), plan.calibration_note) : null,
    h("h2", { class: "synopsis", id: `syn-${key}`, tabindex: "-1", text: plan.synopsis }),
    h(
      "div",
      { class: "brief-cols" },
      h("div", {}, h("h3", { text: "Findings" }), h("ul", { class: "findings" }, plan.findings.map((f) => h("li", { text: f }))), wholeArguments(plan)),
      h("div", {}, h("h3", { text: "Recommendations" }), h("ul", { class: "recommendations" }, plan.recommendations.map((r) => h("li", { text: r })))),
    ),
    h("p", { class: "offer", text: plan.offer }),
  );
  let chosen = null;
  const submit = h("button", { type: "submit", class: "btn btn-primary answer", disabled: true, text: "Choose an option" });
  const options = plan.options.map((o) => {
    const id = `opt-${key}-${o.index}`;
    const input = h("input", { type: "radio", name: `opt-${key}`, id, value: String(o.index) });
    input.addEventListener("change", () => {
      chosen = o.index;
      submit.disabled = false;
      submit.textContent = `Answer: ${o.label}`;
    });
    return h(
      "label",
      { class: `option${o.recommended ? " recommended" : ""}`, for: id, "data-index": String(o.index) },
      input,
      h(
        "span",
        { class: "option-body" },
        h("span", { class: "option-label" }, h("span", { text: o.label }), o.recommended ? h("span", { class: "badge-rec", text: RECOMMENDER[plan.recommended_by] }) : null),
        h("span", { class: "option-reasoning", text: o.reasoning }),
      ),
    );
  });
  const form = h(
    "form",
    {
      class: "decision",
      onsubmit: (ev) => {
        ev.preventDefault();
        if (chosen === null) return;
        resolve(plan.moment_id, { kind: "option", index: chosen }, card, `“${plan.options[chosen].label}”`);
      },
    },
    h("fieldset", {}, h("legend", { class: "stem", text: plan.stem }), options),
    h("div", { class: "actions" }, submit),
  );
  // Every hatch marked true is its own affordance (spec 000 §9.1, §12.3).
  const hatchRow = h("div", { class: "hatches", role: "group", "aria-label": "Escape hatches" });
  const panels = h("div", { class: "hatch-panels" });
  const toggles = []; // [button, panel] of each hatch: one panel open at a time
  const setOpen = (btn, panel, open) => {
    panel.hidden = !open;
    btn.setAttribute("aria-expanded", String(open));
  };
  for (const hatch of plan.hatches) {
    const panelId = `hatch-${hatch.kind}-${key}`;
    const free = hatch.kind === "free_text";
    const err = h("p", { class: "field-error", id: `${panelId}-err`, role: "alert" });
    const ta = h("textarea", {
      id: `${panelId}-text`,
      rows: "3",
      maxlength: "4000",
      "aria-describedby": err.id,
      "aria-required": free ? "true" : null,
      placeholder: free ? "Your answer, in your own words" : "Optional: what is wrong with the question?",
    });
    const invalid = (text) => {
      err.textContent = text;
      if (text) ta.setAttribute("aria-invalid", "true");
      else ta.removeAttribute("aria-invalid");
    };
    ta.addEventListener("input", () => {
      if (ta.value.trim()) invalid("");
    });
    const send = h("button", { type: "submit", class: "btn btn-primary", text: free ? "Send my answer" : "Send: reject the question" });
    let btn;
    const close = () => {
      setOpen(btn, panel, false);
      btn.focus(); // back to the button that opened it (WCAG 2.4.3)
    };
    const panel = h(
      "form",
      {
        class: `hatch-panel hatch-${hatch.kind}`,
        id: panelId,
        hidden: true,
        onkeydown: (ev) => {
          if (ev.key === "Escape") {
            ev.preventDefault();
            close();
          }
        },
        onsubmit: (ev) => {
          ev.preventDefault();
          const text = ta.value.trim();
          if (free) {
            if (!text) {
              // WCAG 3.3.1: the error is named in words, tied to the box, and read out.
              invalid("Write your answer before you send it: the box is empty.");
              ta.focus();
              return;
            }
            resolve(plan.moment_id, { kind: "free_text", text }, card, "your own answer");
          } else {
            resolve(plan.moment_id, text ? { kind: "dialogue", objection: text } : { kind: "dialogue" }, card, "you rejected the question");
          }
        },
      },
      h("label", { for: ta.id, text: free ? hatch.hint : "Reject the question and reopen deliberation with the agent." }),
      ta,
      err,
      h("div", { class: "actions" }, send, h("button", { type: "button", class: "btn btn-quiet", text: "Cancel", onclick: close })),
    );
    btn = h("button", {
      type: "button",
      class: `btn btn-hatch hatch-${hatch.kind}`,
      "aria-controls": panelId,
      "aria-expanded": "false",
      title: hatch.hint,
      onclick: () => {
        const open = panel.hidden;
        for (const [b, p] of toggles) if (p !== panel) setOpen(b, p, false);
        setOpen(btn, panel, open);
        if (open) ta.focus();
      },
      text: hatch.label,
    });
    toggles.push([btn, panel]);
    hatchRow.append(btn);
    panels.append(panel);
  }
  put(
    card,
    cardHeader(plan, plan.hem ? "Approval" : "Decision"),
    untrustedBanner(plan),
    meta.childElementCount ? meta : null,
    briefing,
    h("section", { class: "binding" }, form, plan.hatches.length ? h("div", { class: "hatch-block" }, h("span", { class: "hatch-intro", text: "None of these fits?" }), hatchRow) : null, panels),
    replyBox(),
  );
  return card;
}

function renderClarification(plan, key) {
  const card = h("article", { class: `card card-clarification${plan.untrusted ? " is-untrusted" : ""}`, "data-moment-id": plan.moment_id });
  const inputs = plan.questions.map((q, i) => {
    const id = `q-${key}-${i}`;
    return [q.id, h("div", { class: "question" }, h("label", { for: id, text: q.question }), h("textarea", { id, rows: "2", maxlength: "4000", required: true }))];
  });
  const form = h(
    "form",
    {
      onsubmit: (ev) => {
        ev.preventDefault();
        const answers = {};
        for (const [qid, box] of inputs) answers[qid] = box.querySelector("textarea").value.trim();
        if (Object.values(answers).some((v) => !v)) return;
        resolve(plan.moment_id, { kind: "answers", answers }, card, "your answers");
      },
    },
    inputs.map(([, el]) => el),
    h("div", { class: "actions" }, h("button", { type: "submit", class: "btn btn-primary", text: "Send answers" })),
  );
  put(
    card,
    cardHeader(plan, "Question"),
    untrustedBanner(plan),
    plan.expires_at ? h("div", { class: "meta" }, expiryChip(plan)) : null,
    h("h2", { class: "synopsis", tabindex: "-1", text: plan.questions.length > 1 ? "The agent asks you some questions" : "The agent asks you a question" }),
    form,
    replyBox(),
  );
  return card;
}

function dismissButton(key) {
  return h("div", { class: "actions" }, h("button", { type: "button", class: "btn btn-quiet", text: "Dismiss", onclick: () => removeCard(key) }));
}

function renderAuthorization(plan, key) {
  const blocked = plan.status === "BLOCKED";
  const card = h("article", { class: `card card-authorization${blocked ? " is-blocked" : ""}`, "data-item-id": plan.item_id });
  put(
    card,
    cardHeader(plan, blocked ? "BLOCKED" : "Authorization"),
    untrustedBanner(plan),
    h("h2", { class: "synopsis", tabindex: "-1", text: blocked ? "BLOCKED: this authorization envelope is not shown" : plan.title }),
    h("p", { class: "muted", text: `Workflow ${plan.workflow_id} · variant ${plan.variant}` }),
    h("dl", { class: "fields" }, plan.fields.map((f) => [h("dt", { text: f.label }), h("dd", { text: f.value })])),
    dismissButton(key),
  );
  return card;
}

function renderNotice(plan, key) {
  const card = h("article", { class: "card card-notice", "data-item-id": plan.item_id });
  put(
    card,
    cardHeader(plan, "Notice"),
    untrustedBanner(plan),
    h("h2", { class: "synopsis", tabindex: "-1", text: "Not a decision: shown as a notice" }),
    h("p", { class: "diagnostic", text: plan.diagnostic }),
    plan.conventional !== null ? h("div", {}, h("h3", { text: "What the agent sent" }), h("pre", { class: "conventional", text: plan.conventional })) : null,
    dismissButton(key),
  );
  return card;
}

function renderPlan(plan, key) {
  switch (plan.plan) {
    case "decision":
      return renderDecision(plan, key);
    case "clarification":
      return renderClarification(plan, key);
    case "authorization":
      return renderAuthorization(plan, key);
    default:
      return renderNotice(plan, key);
  }
}

// ---------------------------------------------------------------------------
// Standing approvals (docs/gate.md "Standing approvals"): her live ones, asked
// of the kernel on kernel.approvals.{P} each time the disclosure opens, each
// with a Revoke button; after a revoke the list is asked again and a polite
// status says what happened (WCAG 4.1.3).
// ---------------------------------------------------------------------------

const STANDING_KIND = { session: "Allow for this session", hour: "Allow for an hour" };

// In her words, as the terminal and `pgw approvals` say it (consumers/surfaces/text.py describe_standing).
function describeStanding(a) {
  const where = a.kind === "session" ? "in this session only" : "in any session";
  return `${STANDING_KIND[a.kind] || a.kind}: ${a.tool || a.action} by agent ${a.agent} on files directly in “${a.folder}”, ${where}, until ${fmtTime(a.expires_at, state.timeZone)}`;
}

async function askApprovals(body) {
  try {
    const msg = await state.nc.request(state.subjects.approvals, enc.encode(JSON.stringify(body)), { timeout: 10000 });
    return JSON.parse(dec.decode(msg.data));
  } catch (e) {
    return { ok: false, refusal: { code: "unreachable", reason: `the gateway did not answer (${e.message})` } };
  }
}

function standingStatus(text) {
  document.getElementById("standing-status").textContent = text;
}

async function loadStanding() {
  const box = document.getElementById("standing-list");
  box.setAttribute("aria-busy", "true");
  const reply = await askApprovals({ op: "list" });
  box.removeAttribute("aria-busy");
  if (!reply.ok) {
    box.replaceChildren(h("p", { class: "field-error", text: `Your standing approvals could not be read: ${reply.refusal?.reason || "?"}` }));
    return;
  }
  const approvals = reply.approvals || [];
  if (!approvals.length) {
    box.replaceChildren(h("p", { class: "standing-empty", text: "You have no standing approvals." }));
    return;
  }
  box.replaceChildren(h("ul", { class: "standing-list" }, approvals.map((a) => {
    const id = `standing-${a.scope_id}`;
    const revoke = h("button", {
      type: "button",
      class: "btn btn-hatch",
      "aria-describedby": id,
      text: "Revoke",
      onclick: () => revokeStanding(a, revoke),
    });
    return h(
      "li",
      { class: "standing-item", "data-scope-id": a.scope_id },
      h("p", { id }, describeStanding(a), h("br"), h("span", { class: "muted", text: `Granted ${fmtTime(a.granted_at, state.timeZone)} · id ${a.scope_id}` })),
      revoke,
    );
  })));
}

async function revokeStanding(a, button) {
  // Its button goes with the reloaded list: the focus goes back to the disclosure's button first (WCAG 2.4.3).
  document.getElementById("standing-toggle").focus();
  button.disabled = true;
  const reply = await askApprovals({ op: "revoke", scope_id: a.scope_id });
  standingStatus(reply.ok
    ? `Revoked: ${describeStanding(reply.revoked || a)}. The next such call asks you again.`
    : `Not revoked: ${reply.refusal?.reason || "?"}${reply.refusal?.code ? ` (${reply.refusal.code})` : ""}`);
  await loadStanding();
}

function wireStanding() {
  const toggle = document.getElementById("standing-toggle");
  const panel = document.getElementById("standing-panel");
  toggle.addEventListener("click", () => {
    const open = panel.hidden;
    panel.hidden = !open;
    toggle.setAttribute("aria-expanded", String(open));
    if (!open) return;
    if (!state.nc) {
      document.getElementById("standing-list").replaceChildren(h("p", { class: "standing-empty", text: "Not connected to the gateway yet." }));
      return;
    }
    loadStanding();
  });
}

// ---------------------------------------------------------------------------
// NATS
// ---------------------------------------------------------------------------

function authOptions(auth) {
  if (!auth) return {};
  switch (auth.type) {
    case "nkey":
      return { authenticator: nkeyAuthenticator(enc.encode(auth.value)), ...(auth.inbox_prefix ? { inboxPrefix: auth.inbox_prefix } : {}) };
    case "creds":
      return { authenticator: credsAuthenticator(enc.encode(auth.value)) };
    case "userpass":
      return { user: auth.user, pass: auth.pass };
    case "token":
      return { token: auth.value };
    default:
      throw new Error(`unsupported credentials type ${auth.type}`);
  }
}

async function loadPending({ reconcile = false } = {}) {
  const msg = await state.nc.request(state.subjects.pending, enc.encode("{}"), { timeout: 10000 });
  const reply = JSON.parse(dec.decode(msg.data));
  const items = reply.items || [];
  if (reconcile && !reply.more) {
    // After a reconnect: a moment that left the pending set while we were
    // offline had its `withdrawn` sent then; drop its card now. Not on a reply
    // that says `more`: it is a part of the list, and what it leaves out may
    // still wait.
    const still = new Set(items.map((i) => i && (i.moment_id || i.item_id)));
    for (const [key, card] of [...state.cards]) {
      const answerable = card.plan.plan === "decision" || card.plan.plan === "clarification";
      if (answerable && !still.has(key) && !state.inFlight.has(key)) {
        state.closed.add(key);
        removeCard(key);
        logActivity(`“${card.plan.synopsis || "A question"}” is no longer waiting (answered or expired while this page was offline).`, "withdrawn");
      }
    }
  }
  for (const item of items) accept(item);
}

// The principal's configured zone if this browser knows it, else the browser's own.
function validZone(zone) {
  if (typeof zone !== "string" || !zone) return undefined;
  try {
    new Intl.DateTimeFormat(undefined, { timeZone: zone });
    return zone;
  } catch {
    return undefined;
  }
}

async function main() {
  const registration = registerServiceWorker(); // first, so the shell is cached even if NATS is down
  const cfg = await loadConfig();
  document.getElementById("principal").textContent = `~${cfg.principal}`;
  state.title = `~${cfg.principal} · Principal Gateway`;
  document.title = state.title;
  state.timeZone = validZone(cfg.time_zone);
  const p = `${cfg.prefix}.principal.${cfg.principal}`;
  state.subjects = {
    surface: `${p}.surface`,
    resolve: `${p}.resolve`,
    pending: `${p}.pending`,
    approvals: `${cfg.prefix}.kernel.approvals.${cfg.principal}`,
  };
  wireStanding();
  setConn("connecting", "Connecting…");
  state.nc = await wsconnect({
    servers: cfg.ws_url.split(",").map((u) => u.trim()),
    name: `pgw-surface-web-${cfg.principal}`,
    maxReconnectAttempts: -1,
    reconnectTimeWait: 1000,
    ...authOptions(cfg.auth),
  });
  // Subscribe before asking for the snapshot, so nothing falls in between.
  const queue = [];
  let ready = false;
  const sub = state.nc.subscribe(state.subjects.surface);
  (async () => {
    for await (const m of sub) {
      let item;
      try {
        item = JSON.parse(dec.decode(m.data));
      } catch {
        item = dec.decode(m.data);
      }
      if (ready) accept(item);
      else queue.push(item);
    }
  })();
  await state.nc.flush();
  await loadPending();
  ready = true;
  queue.splice(0).forEach(accept);
  state.loaded = true;
  updateEmpty();
  state.reach = new Reach({ nc: state.nc, prefix: cfg.prefix, principal: cfg.principal, synopsis: cfg.notify_synopsis === true, registration });
  state.reach.start();
  window.pgwReach = state.reach; // for the bus-leg test of the push subscription (tests/test_surface_push.py)
  setConn("connected", "Connected");
  document.body.dataset.ready = "true";
  (async () => {
    for await (const s of state.nc.status()) {
      if (s.type === "disconnect") setConn("offline", "Offline — reconnecting…");
      if (s.type === "reconnect") {
        setConn("connected", "Connected");
        state.reach?.present();
        loadPending({ reconcile: true }).catch(() => {});
      }
    }
  })();
}

main().catch((e) => {
  setConn("offline", "Not connected");
  if (!state.loaded) $empty().hidden = true; // it said "connecting"; the banner below says why not
  const box = document.getElementById("fatal");
  box.hidden = false;
  box.textContent = `Could not connect to the gateway: ${e.message}`;
});
