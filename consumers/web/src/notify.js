// Reaching the principal when they are not looking at the page (issue 17).
//
// - Desktop notifications (Notifications API, shown through the service
//   worker's registration) for a new moment while the page is hidden. By
//   default only "A decision from agent X waits": the synopsis only when the
//   principal opted in (config notify_synopsis). The surface item is already
//   redacted by the pipeline.
// - Web Push: "Notify me on this device" asks for permission (needs a user
//   gesture), gets the notifier's VAPID key on principal.P.push.key, calls
//   pushManager.subscribe and sends the subscription on principal.P.push.subscribe
//   with the principal's own connection (notes/push-contract.md).
// - Presence on principal.P.presence while this page can reach the principal
//   (visible, or hidden with notifications allowed), so the notifier holds
//   back its own push; ttl_s 0 on pagehide.

const enc = new TextEncoder();
const dec = new TextDecoder();

export const PRESENCE_TTL_S = 30;
const ON = "This device is notified when an agent needs you, also when the app is closed.";
const PUSH_SUBSCRIBE_TIMEOUT_MS = 30000;

function randomId() {
  const b = new Uint8Array(12);
  crypto.getRandomValues(b);
  return Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
}

function base64urlBytes(s) {
  const b64 = s.replace(/-/g, "+").replace(/_/g, "/") + "=".repeat((4 - (s.length % 4)) % 4);
  return Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
}

function sameBytes(a, b) {
  if (!a || !b) return false;
  const x = new Uint8Array(a);
  const y = new Uint8Array(b);
  return x.length === y.length && x.every((v, i) => v === y[i]);
}

function withTimeout(promise, ms, what) {
  let timer;
  return Promise.race([
    promise.finally(() => clearTimeout(timer)),
    new Promise((_, reject) => {
      timer = setTimeout(() => reject(new Error(what)), ms);
    }),
  ]);
}

function deviceLabel() {
  const platform = navigator.userAgentData?.platform || navigator.platform || "unknown platform";
  const installed = matchMedia("(display-mode: standalone)").matches ? "installed app" : "browser";
  return `${platform}, ${installed}`;
}

// What a notification for a new moment says: the notifier's words for the
// same moment (consumers/notify/channels.py render), and its tag, so a push
// and this page's notification replace each other instead of stacking.
export const MAX_SYNOPSIS = 300; // as consumers/notify/channels.py
export const tagOf = (momentId) => `pgw-${momentId}`;

export function notificationFor(plan, { synopsis = false } = {}) {
  const what = plan.plan === "clarification" ? "question" : "decision";
  let body = `A ${what} from agent ${plan.agent} waits.`;
  if (synopsis && plan.synopsis) {
    const syn = plan.synopsis.length <= MAX_SYNOPSIS ? plan.synopsis : `${plan.synopsis.slice(0, MAX_SYNOPSIS)}…`;
    body += (plan.untrusted ? "\nUntrusted content: " : "\n") + syn;
  }
  return { title: `A ${what} waits`, body, tag: tagOf(plan.moment_id), url: new URL("/", location.origin).href };
}

export class Reach {
  constructor({ nc, prefix, principal, synopsis, registration }) {
    this.nc = nc;
    this.synopsis = synopsis;
    this.registration = registration; // a Promise of the ServiceWorkerRegistration or null
    const p = `${prefix}.principal.${principal}`;
    this.subjects = { key: `${p}.push.key`, subscribe: `${p}.push.subscribe`, unsubscribe: `${p}.push.unsubscribe`, presence: `${p}.presence` };
    this.instance = randomId();
    this.claimed = false; // the last presence we sent had ttl_s > 0
    this.closed = false; // after pagehide
    this.notified = 0; // notifications this page has shown
    this.subscribed = false; // this browser holds a push subscription (the button turns it off)
    this.timer = null;
  }

  start() {
    this.resume();
    document.addEventListener("visibilitychange", () => this.present());
    window.addEventListener("pagehide", () => this.gone());
    // Back from the back/forward cache: the same page is open again.
    window.addEventListener("pageshow", (ev) => ev.persisted && this.resume());
    this.mountControls();
    this.resync().catch(() => {});
  }

  supported() {
    return "Notification" in window && "serviceWorker" in navigator && window.isSecureContext;
  }

  // The page reaches the principal when it is looked at, or can notify them.
  reachable() {
    return document.visibilityState === "visible" || (this.supported() && Notification.permission === "granted");
  }

  publishPresence(ttl) {
    const body = { instance: this.instance, surface: "web", ttl_s: ttl };
    try {
      this.nc.publish(this.subjects.presence, enc.encode(JSON.stringify(body)));
      this.nc.flush().catch(() => {});
    } catch {
      // closed connection: the notifier's expiry covers it
    }
    this.claimed = ttl > 0;
  }

  present() {
    if (this.closed) return; // the page is going: a visibilitychange after pagehide must not re-claim
    if (this.reachable()) this.publishPresence(PRESENCE_TTL_S);
    else if (this.claimed) this.publishPresence(0);
  }

  resume() {
    this.closed = false;
    clearInterval(this.timer);
    this.timer = setInterval(() => this.present(), (PRESENCE_TTL_S * 1000) / 3);
    this.present();
  }

  gone() {
    this.closed = true;
    clearInterval(this.timer);
    this.publishPresence(0);
  }

  // A new moment arrived (not one listed when the page opened).
  async arrived(plan) {
    if (plan.plan !== "decision" && plan.plan !== "clarification") return;
    if (document.visibilityState !== "hidden" || !this.supported() || Notification.permission !== "granted") return;
    const reg = await this.registration;
    if (!reg) return;
    const n = notificationFor(plan, { synopsis: this.synopsis });
    try {
      await reg.showNotification(n.title, { body: n.body, tag: n.tag, data: { url: n.url }, icon: "/static/icons/icon-192.png" });
      this.notified += 1;
      document.documentElement.dataset.notified = String(this.notified); // shown: tests read getNotifications() after this
    } catch (e) {
      console.warn(`notification not shown: ${e.message}`);
    }
  }

  // A moment was answered, withdrawn or expired: its notification is stale.
  async withdrawn(momentId) {
    const reg = await this.registration;
    if (!reg || !momentId || !this.supported()) return;
    for (const n of await reg.getNotifications({ tag: tagOf(momentId) })) n.close();
  }

  async request(subject, body) {
    const msg = await this.nc.request(subject, enc.encode(JSON.stringify(body)), { timeout: 10000 });
    return JSON.parse(dec.decode(msg.data));
  }

  // Send a PushSubscription (its toJSON()) to the notifier with this page's own connection.
  async sendSubscription(subscription) {
    return this.request(this.subjects.subscribe, { subscription, device: deviceLabel() });
  }

  // ---- "Notify me on this device" --------------------------------------------------

  mountControls() {
    this.$bar = document.getElementById("reach");
    this.$status = document.getElementById("reach-status");
    this.$button = document.getElementById("notify-me");
    if (!this.$bar) return;
    this.$button.addEventListener("click", () => {
      const act = this.subscribed ? this.disable() : this.enable();
      act.catch((e) => this.status(`Something went wrong: ${e.message}`, "refused"));
    });
    this.$bar.hidden = false;
    this.describe();
  }

  // done: nothing more to offer; subscribed: the button turns push off again.
  status(text, kind = "info", { done = false, subscribed = false } = {}) {
    this.subscribed = subscribed;
    this.$status.textContent = text;
    this.$status.dataset.kind = kind;
    this.$button.textContent = subscribed ? "Stop notifications on this device" : "Notify me on this device";
    this.$button.className = subscribed ? "btn btn-quiet" : "btn btn-primary";
    this.$button.hidden = done;
    this.$button.disabled = false;
  }

  async describe() {
    if (!window.isSecureContext) {
      return this.status("Notifications need a secure connection: open the app on https:// or on localhost.", "refused", { done: true });
    }
    if (!this.supported()) {
      const ios = /iPhone|iPad|iPod/.test(navigator.userAgent) && !matchMedia("(display-mode: standalone)").matches;
      return this.status(
        ios
          ? "On iPhone and iPad, notifications need the installed app: Share → Add to Home Screen (iOS 16.4 or later), then open it from there."
          : "This browser cannot show notifications for web pages.",
        "refused",
        { done: true },
      );
    }
    if (Notification.permission === "denied") {
      return this.status("Notifications are blocked for this site. Allow them in the browser's site settings, then press the button.", "refused");
    }
    if (Notification.permission === "granted") {
      const reg = await this.registration;
      const sub = reg && "pushManager" in reg ? await reg.pushManager.getSubscription() : null;
      if (sub) return this.status(ON, "ok", { subscribed: true });
      return this.status("Notifications are on while this app is open. Press the button to be notified when it is closed too.", "info");
    }
    return this.status("Get a notification on this device when an agent needs you.", "info");
  }

  async enable() {
    this.$button.disabled = true;
    if (!this.supported()) return this.describe();
    this.status("Asking the browser for permission…");
    const permission = await Notification.requestPermission();
    if (permission === "denied") {
      return this.status("Notifications were refused. Allow them in the browser's site settings, then press the button again.", "refused");
    }
    if (permission !== "granted") return this.status("You closed the question; nothing changed. Press the button to be asked again.", "info");
    this.present(); // hidden pages now count as present: they can notify
    const open = "Notifications are on while this app is open";
    const reg = await this.registration;
    if (!reg || !("pushManager" in reg)) {
      return this.status(`${open}. This browser has no Web Push, so nothing reaches you when the app is closed.`, "info", { done: true });
    }
    this.status(`${open}. Setting up push for when it is closed…`);
    let key;
    try {
      key = await this.request(this.subjects.key, {});
    } catch (e) {
      return this.status(`${open}. Push when it is closed is unavailable: the gateway's notifier did not answer (${e.message}).`, "refused");
    }
    if (!key.ok) return this.status(`${open}. The notifier refused: ${key.detail || key.error}.`, "refused");
    let sub;
    try {
      sub = await withTimeout(this.subscribe(reg, key.vapid_public_key), PUSH_SUBSCRIBE_TIMEOUT_MS, "its push service did not answer within 30 s");
    } catch (e) {
      return this.status(`${open}. This browser could not register with its push service: ${e.message}.`, "refused");
    }
    const reply = await this.sendSubscription(sub.toJSON());
    if (!reply.ok) return this.status(`${open}. The notifier refused this device: ${reply.detail || reply.error}.`, "refused");
    return this.status(ON, "ok", { subscribed: true });
  }

  // "Stop notifications on this device": the browser drops its subscription and
  // the notifier forgets the endpoint (principal.P.push.unsubscribe).
  async disable() {
    this.$button.disabled = true;
    const reg = await this.registration;
    const sub = reg && "pushManager" in reg ? await reg.pushManager.getSubscription() : null;
    if (sub) {
      await sub.unsubscribe();
      await this.forget(sub.endpoint).catch(() => {}); // the push service refuses it from now on anyway
    }
    return this.status("This device is no longer notified when the app is closed.", "info");
  }

  async forget(endpoint) {
    return this.request(this.subjects.unsubscribe, { endpoint });
  }

  async subscribe(reg, vapidKey) {
    const applicationServerKey = base64urlBytes(vapidKey);
    const existing = await reg.pushManager.getSubscription();
    if (existing && sameBytes(existing.options.applicationServerKey, applicationServerKey)) return existing;
    if (existing) await existing.unsubscribe(); // the notifier has a new key: the old endpoint is useless
    return reg.pushManager.subscribe({ userVisibleOnly: true, applicationServerKey });
  }

  // On every start: a subscription this browser still holds is sent again
  // (idempotent: the notifier keys it by endpoint), in case the notifier lost it.
  async resync() {
    if (!this.supported() || Notification.permission !== "granted") return;
    const reg = await this.registration;
    const sub = reg && "pushManager" in reg ? await reg.pushManager.getSubscription() : null;
    if (sub) await this.sendSubscription(sub.toJSON());
  }
}
