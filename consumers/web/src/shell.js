// The installable app's shell (issue 17): the page token and the service worker.
//
// The page server hands out the page's settings (which may carry the
// principal's NATS credentials) only with the token in the URL that
// `pgw surface-web` printed. An installed app starts at the manifest's
// start_url, "/", without it: the page keeps the token from the first open
// in localStorage (this origin only; the page runs only its own script, CSP
// script-src 'self') and takes it off the address bar. Never the settings
// themselves: they are fetched anew on every start and never cached.

const TOKEN_KEY = "pgw.surface-web.token";

function storage() {
  try {
    return window.localStorage;
  } catch {
    return null; // storage disabled: the printed URL must then be opened every time
  }
}

export async function loadConfig() {
  const url = new URL(location.href);
  const fromUrl = url.searchParams.get("t");
  const token = fromUrl || storage()?.getItem(TOKEN_KEY) || "";
  let resp;
  try {
    resp = await fetch(`/config.json?t=${encodeURIComponent(token)}`, { cache: "no-store" });
  } catch (e) {
    throw new Error(`the page server does not answer (${e.message}); is \`pgw surface-web\` running?`);
  }
  if (resp.status === 403) {
    if (!fromUrl) storage()?.removeItem(TOKEN_KEY);
    throw new Error(
      token && !fromUrl
        ? "the token this device kept is no longer valid (`pgw surface-web --new-token`?). Open the URL it printed once more."
        : "open the URL that `pgw surface-web` printed (once per device; the app then remembers it).",
    );
  }
  if (!resp.ok) throw new Error(`the page server answered ${resp.status} for the settings`);
  const cfg = await resp.json();
  if (fromUrl) {
    storage()?.setItem(TOKEN_KEY, fromUrl);
    url.searchParams.delete("t");
    history.replaceState(null, "", url.pathname + url.search + url.hash); // not in bookmarks or shared links
  }
  return cfg;
}

// Resolves to the ServiceWorkerRegistration, or null where there is none
// (no secure context: plain http on a non-loopback host; or no support).
export async function registerServiceWorker() {
  if (!("serviceWorker" in navigator)) return null;
  try {
    await navigator.serviceWorker.register("/sw.js", { scope: "/" });
    return await navigator.serviceWorker.ready;
  } catch (e) {
    console.warn(`service worker not registered: ${e.message}`);
    return null;
  }
}
