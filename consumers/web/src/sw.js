// The service worker of the installable app (issue 17), served at /sw.js so
// its scope is the whole origin.
//
// - Caches the app shell, so the installed app opens (and says it is offline)
//   without the network. Network first: the page server is local and sends
//   no-store, so a rebuilt bundle is picked up on the next start.
// - Never caches /config.json (it may carry the principal's credentials).
// - Shows a Web Push message (notes/push-contract.md): the decrypted payload
//   is {"title", "body", "url", "moment_id", "tag"}; a click focuses the app
//   or opens the url (this origin only).

const SHELL = "pgw-shell-v1";
const ASSETS = [
  "/",
  "/static/app.js",
  "/static/style.css",
  "/manifest.webmanifest",
  "/static/icons/icon-192.png",
  "/static/icons/icon-512.png",
  "/static/icons/icon-maskable-512.png",
];
const NEVER = new Set(["/config.json", "/sw.js"]);

self.addEventListener("install", (event) => {
  event.waitUntil(
    caches
      .open(SHELL)
      .then((cache) => cache.addAll(ASSETS))
      .then(() => self.skipWaiting()),
  );
});

self.addEventListener("activate", (event) => {
  event.waitUntil(
    caches
      .keys()
      .then((keys) => Promise.all(keys.filter((k) => k !== SHELL).map((k) => caches.delete(k))))
      .then(() => self.clients.claim()),
  );
});

async function networkFirst(request, shellPath) {
  const cache = await caches.open(SHELL);
  try {
    const resp = await fetch(request);
    if (resp.ok) await cache.put(shellPath, resp.clone());
    return resp;
  } catch (e) {
    const hit = await cache.match(shellPath);
    if (hit) return hit;
    throw e;
  }
}

self.addEventListener("fetch", (event) => {
  const req = event.request;
  if (req.method !== "GET") return;
  const url = new URL(req.url);
  if (url.origin !== self.location.origin || NEVER.has(url.pathname)) return;
  if (req.mode === "navigate" && url.pathname === "/") {
    event.respondWith(networkFirst(req, "/")); // "/?t=…" too: one cached page, no token kept in the cache
  } else if (ASSETS.includes(url.pathname) && url.search === "") {
    event.respondWith(networkFirst(req, url.pathname));
  }
});

// A URL to open on click: the payload's, when it is on this origin; else the app.
function target(url) {
  try {
    const u = new URL(url, self.location.origin);
    if (u.origin === self.location.origin) return u.href;
  } catch {
    // not a URL
  }
  return new URL("/", self.location.origin).href;
}

self.addEventListener("push", (event) => {
  let msg = {};
  try {
    msg = event.data ? event.data.json() : {};
  } catch {
    msg = {};
  }
  const title = typeof msg.title === "string" && msg.title ? msg.title : "A decision waits for you";
  const options = {
    body: typeof msg.body === "string" ? msg.body : "",
    tag: typeof msg.tag === "string" && msg.tag ? msg.tag : typeof msg.moment_id === "string" ? msg.moment_id : undefined,
    data: { url: target(msg.url) },
    icon: "/static/icons/icon-192.png",
    badge: "/static/icons/icon-192.png",
  };
  event.waitUntil(self.registration.showNotification(title, options));
});

self.addEventListener("notificationclick", (event) => {
  event.notification.close();
  const url = target(event.notification.data && event.notification.data.url);
  event.waitUntil(
    (async () => {
      const windows = await self.clients.matchAll({ type: "window", includeUncontrolled: true });
      for (const client of windows) {
        if (new URL(client.url).origin === self.location.origin && "focus" in client) return client.focus();
      }
      return self.clients.openWindow(url);
    })(),
  );
});
