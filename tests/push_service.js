// A push service stand-in for the notifier's tests (issue 17), on loopback.
//
// It plays both ends a browser and its push service would: POST /subs makes a
// subscription the way PushManager.subscribe() does (a P-256 key pair and a
// 16-byte auth secret, kept here), and POST /push/<id> receives a push message
// (RFC 8030 §5), checks the VAPID Authorization (RFC 8292: ES256 signature with
// the k= public key, aud = this origin, exp within 24 h, sub present) with
// node:crypto, and DECRYPTS the body with Martin Thomson's reference
// implementation of RFC 8188 / RFC 8291 (npm http_ece), never with the
// notifier's own code. POST /respond/<id> {"statuses": [500, 410, ...]} sets
// the answers the next pushes get (then 201); GET /received lists what came.
//
// Usage: node push_service.js <folder holding node_modules/http_ece>
'use strict';
const http = require('node:http');
const crypto = require('node:crypto');
const path = require('node:path');
const ece = require(path.join(process.argv[2], 'node_modules', 'http_ece'));

const subs = new Map(); // id -> {ecdh, auth, statuses}
const received = [];
let port = 0;

const b64u = (buf) => Buffer.from(buf).toString('base64url');

function checkVapid(header, origin) {
  // RFC 8292 §3.1: Authorization: vapid t=<JWT>, k=<base64url P-256 point>
  const m = /^vapid\s+(.*)$/i.exec(header || '');
  if (!m) return { ok: false, error: 'no vapid Authorization' };
  const params = {};
  for (const part of m[1].split(',')) {
    const i = part.indexOf('=');
    if (i > 0) params[part.slice(0, i).trim()] = part.slice(i + 1).trim();
  }
  if (!params.t || !params.k) return { ok: false, error: 'vapid t= or k= missing' };
  const [h, c, s] = params.t.split('.');
  const jh = JSON.parse(Buffer.from(h, 'base64url'));
  const claims = JSON.parse(Buffer.from(c, 'base64url'));
  const raw = Buffer.from(params.k, 'base64url');
  if (raw.length !== 65 || raw[0] !== 4) return { ok: false, error: 'k is not an uncompressed P-256 point' };
  const key = crypto.createPublicKey({
    key: { kty: 'EC', crv: 'P-256', x: b64u(raw.subarray(1, 33)), y: b64u(raw.subarray(33)) }, format: 'jwk',
  });
  const good = crypto.verify('sha256', Buffer.from(`${h}.${c}`), { key, dsaEncoding: 'ieee-p1363' },
    Buffer.from(s, 'base64url'));
  const now = Math.floor(Date.now() / 1000);
  const errors = [];
  if (jh.alg !== 'ES256') errors.push(`alg ${jh.alg}`);
  if (!good) errors.push('ES256 signature does not verify with k');
  if (claims.aud !== origin) errors.push(`aud ${claims.aud} is not ${origin}`);
  if (!(claims.exp > now && claims.exp <= now + 24 * 3600)) errors.push(`exp ${claims.exp} not within 24 h`);
  if (typeof claims.sub !== 'string' || !/^(mailto:|https:)/.test(claims.sub)) errors.push('sub missing');
  return { ok: errors.length === 0, error: errors.join('; '), claims, k: params.k };
}

function body(req) {
  return new Promise((resolve) => {
    const chunks = [];
    req.on('data', (d) => chunks.push(d));
    req.on('end', () => resolve(Buffer.concat(chunks)));
  });
}

function reply(res, status, obj) {
  res.writeHead(status, { 'Content-Type': 'application/json' });
  res.end(obj === undefined ? '' : JSON.stringify(obj));
}

const server = http.createServer(async (req, res) => {
  const data = await body(req);
  const url = new URL(req.url, `http://127.0.0.1:${port}`);
  const parts = url.pathname.split('/').filter(Boolean);
  try {
    if (req.method === 'POST' && parts[0] === 'subs') {
      const id = crypto.randomBytes(8).toString('hex');
      const ecdh = crypto.createECDH('prime256v1');
      ecdh.generateKeys();
      const auth = crypto.randomBytes(16);
      subs.set(id, { ecdh, auth, statuses: [] });
      return reply(res, 200, {
        id,
        subscription: {
          endpoint: `http://127.0.0.1:${port}/push/${id}`, expirationTime: null,
          keys: { p256dh: b64u(ecdh.getPublicKey()), auth: b64u(auth) },
        },
      });
    }
    if (req.method === 'POST' && parts[0] === 'respond') {
      subs.get(parts[1]).statuses.push(...JSON.parse(data).statuses);
      return reply(res, 200, { ok: true });
    }
    if (req.method === 'GET' && parts[0] === 'received') return reply(res, 200, received);
    if (req.method === 'POST' && parts[0] === 'push') {
      const sub = subs.get(parts[1]);
      if (!sub) return reply(res, 404, { error: 'no such subscription' });
      const status = sub.statuses.length ? sub.statuses.shift() : 201;
      const rec = {
        id: parts[1], status, ttl: req.headers.ttl, topic: req.headers.topic, urgency: req.headers.urgency,
        encoding: req.headers['content-encoding'],
      };
      const v = checkVapid(req.headers.authorization, `http://127.0.0.1:${port}`);
      rec.vapid_ok = v.ok; rec.vapid_error = v.error; rec.claims = v.claims; rec.vapid_k = v.k;
      try {
        const plain = ece.decrypt(data, { version: 'aes128gcm', privateKey: sub.ecdh, authSecret: b64u(sub.auth) });
        rec.payload = JSON.parse(plain.toString('utf8'));
      } catch (e) {
        rec.decrypt_error = String(e);
      }
      received.push(rec);
      if (!rec.vapid_ok || rec.decrypt_error) return reply(res, 400, { error: rec.vapid_error || rec.decrypt_error });
      res.writeHead(status, status === 201 ? { Location: `/msg/${received.length}` } : {});
      return res.end();
    }
    return reply(res, 404, { error: 'unknown path' });
  } catch (e) {
    return reply(res, 500, { error: String(e) });
  }
});

server.listen(0, '127.0.0.1', () => {
  port = server.address().port;
  process.stdout.write(`LISTENING ${port}\n`);
});
