// DOM helpers of the browser surface: textContent only, agent text is never
// parsed as HTML (spec 000 §9; used by app.js and notify.js).

export function put(el, ...children) {
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "text") el.textContent = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : v);
  }
  return put(el, ...children);
}

// A moment in time, in `timeZone` (an IANA name; undefined: the browser's), the
// zone named ("21:00 GMT+1"): a deadline read on a phone abroad must say which
// clock it means (docs/surfaces.md "Accessibility").
export function fmtTime(ts, timeZone = undefined) {
  if (!ts) return "";
  const d = new Date(ts);
  if (Number.isNaN(d.getTime())) return ts;
  return d.toLocaleString(undefined, {
    day: "numeric", month: "short", year: "numeric", hour: "2-digit", minute: "2-digit", timeZoneName: "short", timeZone,
  });
}
