// A zero-delay OpenAI-compatible upstream for throughput runs: every chat
// completion is answered at once with DELTAS content pieces, streamed as SSE
// (`"stream": true`) or as one JSON body. It does no work a real model would,
// so that what is measured in front of it is the proxy, not the backend.
// Usage: node upstream.js PORT [DELTAS]
// With UPSTREAM_CERT and UPSTREAM_KEY (PEM files) it serves HTTPS; with UPSTREAM_H2=1
// as well, HTTP/2 over ALPN (and HTTP/1.1 to a client that offers only that).
// With UPSTREAM_EVENT_WRITES=1 a stream's events are written one a tick, as a provider
// writes each as it comes (over TLS: each event a record of its own).
"use strict";
const fs = require("fs");
const http = require("http");

const port = Number(process.argv[2] || 8200);
const deltas = Number(process.argv[3] || 16);
const words = Array.from({ length: deltas }, (_, i) => (i ? " w" : "w") + i);
const created = Math.floor(Date.now() / 1000);

function chunk(id, model, delta, finish) {
  return "data: " + JSON.stringify({
    id, object: "chat.completion.chunk", created, model,
    choices: [{ index: 0, delta, finish_reason: finish }],
  }) + "\n\n";
}

function events(id, model) {
  const out = [chunk(id, model, { role: "assistant", content: "" }, null)];
  for (const w of words) out.push(chunk(id, model, { content: w }, null));
  out.push(chunk(id, model, {}, "stop"));
  out.push("data: " + JSON.stringify({
    id, object: "chat.completion.chunk", created, model, choices: [],
    usage: { prompt_tokens: 8, completion_tokens: deltas, total_tokens: 8 + deltas },
  }) + "\n\n");
  out.push("data: [DONE]\n\n");
  return out;
}

function streamed(id, model) {
  return events(id, model).join("");
}

const eventWrites = process.env.UPSTREAM_EVENT_WRITES === "1";

function writeEach(res, parts, i) {
  if (i === parts.length - 1) { res.end(parts[i]); return; }
  res.write(parts[i]);
  setImmediate(writeEach, res, parts, i + 1);
}

function whole(id, model) {
  return JSON.stringify({
    id, object: "chat.completion", created, model,
    choices: [{ index: 0, message: { role: "assistant", content: words.join("") }, finish_reason: "stop" }],
    usage: { prompt_tokens: 8, completion_tokens: deltas, total_tokens: 8 + deltas },
  });
}

let n = 0;
function handler(req, res) {
  if (req.method === "GET") {
    res.writeHead(200, { "content-type": "application/json" });
    res.end(JSON.stringify({ object: "list", data: [{ id: "sim-model", object: "model" }] }));
    return;
  }
  const parts = [];
  req.on("data", (c) => parts.push(c));
  req.on("end", () => {
    let body = {};
    try { body = JSON.parse(Buffer.concat(parts).toString() || "{}"); } catch (e) { /* answered anyway */ }
    const id = "chatcmpl-up" + (n++);
    const model = body.model || "sim-model";
    if (body.stream) {
      res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" });
      if (eventWrites) writeEach(res, events(id, model), 0);
      else res.end(streamed(id, model));
    } else {
      const text = whole(id, model);
      res.writeHead(200, { "content-type": "application/json", "content-length": Buffer.byteLength(text) });
      res.end(text);
    }
  });
}

const cert = process.env.UPSTREAM_CERT;
const key = process.env.UPSTREAM_KEY;
let server;
if (cert && key) {
  const tls = { cert: fs.readFileSync(cert), key: fs.readFileSync(key) };
  server = process.env.UPSTREAM_H2 === "1"
    ? require("http2").createSecureServer({ ...tls, allowHTTP1: true }, handler)
    : require("https").createServer(tls, handler);
} else {
  server = http.createServer(handler);
}
server.listen(port, "127.0.0.1");
