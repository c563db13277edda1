// ivr live call console. Plain JS, no build step. Data reaches the page as text only
// (textContent, never innerHTML): transcripts are what callers said.
"use strict";

const TOKEN_KEY = "ivr-console-token";
const $ = (id) => document.getElementById(id);
const state = {
  token: sessionStorage.getItem(TOKEN_KEY),
  piiAllowed: false,
  selected: null,   // CallSid shown in the call panel
  active: [],       // rows of the last `active` event
  receivedAt: 0,    // when they arrived (durations tick from there)
  source: null,     // the EventSource
  retry: 1000,
  epoch: 0,         // bumps on every (re)connect: late callbacks of old streams are ignored
};

function pii() { return state.piiAllowed && $("pii").checked; }

async function api(path, options = {}) {
  const headers = { Authorization: `Bearer ${state.token}` };
  const response = await fetch(path, { ...options, headers, cache: "no-store" });
  if (response.status === 401) { signOut("The token was refused."); throw new Error("401"); }
  if (!response.ok) throw new Error(`${response.status} ${await response.text()}`);
  return response.json();
}

function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v) q.set(k, v === true ? "true" : v);
  const s = q.toString();
  return s ? `?${s}` : "";
}

// -- sign in / out -----------------------------------------------------------------------

async function signIn(token) {
  state.token = token;
  const session = await api("/console/api/session", { method: "POST" });
  sessionStorage.setItem(TOKEN_KEY, token);
  state.piiAllowed = session.pii_allowed;
  $("pii-toggle").hidden = !state.piiAllowed;
  $("login").hidden = true;
  $("console").hidden = false;
  $("logout").hidden = false;
  connect();
  searchEnded();
}

function signOut(message = "") {
  sessionStorage.removeItem(TOKEN_KEY);
  state.token = null;
  state.epoch += 1;
  if (state.source) state.source.close();
  state.source = null;
  $("console").hidden = true;
  $("login").hidden = false;
  $("logout").hidden = true;
  $("login-error").textContent = message;
  setLink("off", "signed out");
}

function setLink(kind, text) {
  const badge = $("link-state");
  badge.className = `badge ${kind}`;
  badge.textContent = text;
}

// -- the event stream --------------------------------------------------------------------

async function connect() {
  const epoch = ++state.epoch;
  if (state.source) state.source.close();
  state.source = null;
  let ticket;
  try {
    ticket = (await api(`/console/api/ticket${query({ pii: pii() })}`, { method: "POST" })).ticket;
  } catch (err) {
    if (state.token) reconnectLater(epoch);
    return;
  }
  if (epoch !== state.epoch) return;
  const source = new EventSource(`/console/api/events${query({ ticket, call: state.selected })}`);
  state.source = source;
  const live = (fn) => (ev) => { if (epoch === state.epoch) fn(JSON.parse(ev.data)); };
  source.addEventListener("hello", live(() => { state.retry = 1000; setLink("live", "live"); }));
  source.addEventListener("active", live(renderActive));
  source.addEventListener("call", live(renderCall));
  source.addEventListener("ended", live((data) => { openCall(data.call_sid); searchEnded(); }));
  source.addEventListener("bye", live(() => connect()));
  source.onerror = () => {
    if (epoch !== state.epoch) return;
    source.close();
    setLink("retry", "reconnecting");
    reconnectLater(epoch);
  };
}

function reconnectLater(epoch) {
  const delay = state.retry;
  state.retry = Math.min(state.retry * 2, 15000);
  setTimeout(() => { if (epoch === state.epoch && state.token) connect(); }, delay);
}

// -- active calls ------------------------------------------------------------------------

function renderActive(data) {
  const ended = state.active.filter((c) => !data.calls.some((n) => n.call_sid === c.call_sid));
  state.active = data.calls;
  state.receivedAt = Date.now();
  $("store-error").hidden = !data.error;
  $("store-error").textContent = data.error ? `Store unreachable: ${data.error}` : "";
  $("active-count").textContent = String(data.calls.length);
  $("active-empty").hidden = data.calls.length > 0;
  const body = $("active-table").tBodies[0];
  body.replaceChildren(...data.calls.map((call) => activeRow(call)));
  tickDurations();
  if (ended.length) searchEnded();
}

function activeRow(call) {
  const row = cells([call.caller, call.flow, call.node, "", call.instance, call.status]);
  row.dataset.sid = call.call_sid;
  row.classList.toggle("selected", call.call_sid === state.selected);
  row.addEventListener("click", () => selectCall(call.call_sid));
  return row;
}

function tickDurations() {
  const elapsed = (Date.now() - state.receivedAt) / 1000;
  for (const row of $("active-table").tBodies[0].rows) {
    const call = state.active.find((c) => c.call_sid === row.dataset.sid);
    if (call) row.cells[3].textContent = duration(call.duration_s + elapsed);
  }
}

function selectCall(sid) {
  state.selected = sid;
  for (const row of document.querySelectorAll("tr[data-sid]")) {
    row.classList.toggle("selected", row.dataset.sid === sid);
  }
  if (state.active.some((c) => c.call_sid === sid)) connect();  // the stream sends it live
  else openCall(sid);
}

async function openCall(sid) {
  try {
    const call = await api(`/console/api/calls/${encodeURIComponent(sid)}${query({ pii: pii() })}`);
    if (state.selected === sid) renderCall(call);
  } catch (err) {
    $("call-title").textContent = `${sid}: ${err.message}`;
  }
}

// -- one call ----------------------------------------------------------------------------

function renderCall(call) {
  if (!call || call.call_sid !== state.selected) return;
  $("call-title").textContent = call.call_sid;
  const facts = [
    ["caller", call.caller], ["flow", call.flow], ["node", call.node], ["status", call.status],
    ["outcome", call.outcome === "live" ? "live" : `${call.outcome}: ${call.outcome_meaning}`,
      call.outcome_meaning], ["instance", call.instance],
    ["duration", duration(call.duration_s)], ["turns", String(call.turns)],
  ];
  if (call.twilio_status) facts.push(["Twilio", twilioStatus(call)]);
  if (call.transfer_to) facts.push(["transfer to", call.transfer_to]);
  $("call-facts").replaceChildren(...facts.map(([k, v, title]) => fact(k, v, title)));
  $("transcript").replaceChildren(...call.transcript.map(transcriptLine));
  $("events").replaceChildren(...call.events.map(eventLine));
  renderWaterfall(call.waterfall);
  renderTotals(call.totals);
  renderRecording(call);
}

// -- the recording player ----------------------------------------------------------------
// An <audio src> cannot send the bearer token, so each part is fetched with it and played
// from a blob: URL (freed when another call is shown).

const recording = { key: "", urls: [] };

function renderRecording(call) {
  const count = call.recordings || 0;
  const key = `${call.call_sid}:${count}`;
  if (key === recording.key) return;
  recording.key = key;
  for (const url of recording.urls) URL.revokeObjectURL(url);
  recording.urls = [];
  $("recording").hidden = count === 0;
  $("recording-error").textContent = "";
  $("recording-parts").replaceChildren(...Array.from({ length: count }, (_, part) => {
    const audio = document.createElement("audio");
    audio.controls = true;
    audio.preload = "metadata";
    audio.dataset.part = String(part);
    loadRecording(call.call_sid, part, audio, key);
    return audio;
  }));
}

async function loadRecording(sid, part, audio, key) {
  const path = `/console/api/calls/${encodeURIComponent(sid)}/recording?part=${part}`;
  try {
    const response = await fetch(path, {
      headers: { Authorization: `Bearer ${state.token}` }, cache: "no-store",
    });
    if (response.status === 401) { signOut("The token was refused."); return; }
    if (!response.ok) throw new Error(`${response.status} ${await response.text()}`);
    const blob = await response.blob();
    if (recording.key !== key) return;  // another call is shown by now
    const url = URL.createObjectURL(blob);
    recording.urls.push(url);
    audio.src = url;
  } catch (err) {
    if (recording.key === key) $("recording-error").textContent = `Recording ${part + 1}: ${err.message}`;
  }
}

function fact(name, value, title) {
  const div = document.createElement("div");
  const dd = el("dd", value || "-");
  if (title) dd.title = title;
  div.append(el("dt", name), dd);
  div.dataset.fact = name;
  return div;
}

const WHO = { caller: "caller", bot: "bot (as heard)", tool: "tool call", tool_result: "tool result" };

function words(text, side) {
  return text.split(/\s+/).filter(Boolean).map((word) => {
    const span = el("span", word);
    span.className = `word ${side}`;
    if (side === "unheard") span.title = "written, not heard: the caller cut in";
    return span;
  });
}

function transcriptLine(line) {
  const li = el("li", "");
  li.className = line.who + (line.cut ? " cut" : "");
  const who = el("span", WHO[line.who] || line.who);
  who.className = "who";
  if (!line.unheard) {
    li.append(who, document.createTextNode(line.text));
  } else {  // the barge-in kept the words not heard: each word on its side of the cut
    li.append(who, ...words(line.text, "heard"));
  }
  if (line.cut) {
    const mark = el("span", "⟂ barge-in: cut here");
    mark.className = "cut-mark";
    li.append(mark);
  }
  if (line.unheard) li.append(...words(line.unheard, "unheard"));
  return li;
}

function eventLine(event) {
  const time = new Date(event.at).toLocaleTimeString();
  const text = {
    seen: () => `seen at node ${event.to} (${event.status})`,
    node: () => `node ${event.from || "-"} → ${event.to}`,
    dtmf: () => `⌨ key press ${event.digits} at ${event.node || "-"}`,
    barge_in: () => `⟂ barge-in at ${event.node || "-"}` + (event.heard ? `: heard "${event.heard}"` : ""),
    backchannel: () => `caller backchannel over the bot (${event.span_ms} ms): ` +
      (event.paused ? "it paused, then went on" : "it played on"),
    status: () => `status ${event.from} → ${event.to}`,
    stream: () => `stream ${event.streams} on ${event.to}`,
    transfer: () => `transfer to ${event.number}`,
    ended: () => `ended: ${event.to}`,
    twilio_stream: () => `Twilio: ${event.event}` + (event.error ? ` (${event.error})` : ""),
    twilio_status: () => `Twilio: call ${event.status}` +
      (event.seconds === null || event.seconds === undefined ? "" : `, billed ${event.seconds} s`),
  }[event.kind];
  const li = el("li", `${time}  ${text ? text() : event.kind}`);
  li.className = `event ${event.kind}`;
  return li;
}

function renderWaterfall(turns) {
  const scale = Math.max(0.5, ...turns.map((t) => Math.max(t.heard || 0, t.total || 0,
    ...t.stages.map((s) => s.start + s.length))));
  $("waterfall").replaceChildren(...turns.map((turn, i) => {
    const box = el("div", "");
    box.className = "turn";
    const head = el("div", `Turn ${i + 1}: ${ms(turn.total)} to first audio, ${ms(turn.heard)} heard`);
    head.className = "turn-head" + (turn.slow ? " slow" : "");
    box.append(head, ...turn.stages.map((stage) => stageRow(stage, scale)));
    return box;
  }));
}

function stageRow(stage, scale) {
  const row = el("div", "");
  row.className = `stage ${stage.key}` + (stage.slow ? " slow" : "");
  row.dataset.stage = stage.key;
  const track = el("div", "");
  track.className = "track";
  const bar = el("div", "");
  bar.className = `bar ${stage.key}`;
  bar.style.left = `${(100 * stage.start) / scale}%`;
  bar.style.width = `${(100 * stage.length) / scale}%`;
  track.append(bar);
  const value = el("span", ms(stage.seconds));
  value.className = "ms";
  row.append(el("span", stage.label), track, value);
  return row;
}

const TOTAL_LABELS = {
  endpoint_silence: "endpoint silence", stt: "STT", llm_ttft: "LLM first token",
  llm_first_clause: "first sentence", tts_ttfb: "TTS first byte", gateway: "gateway",
  total: "total (sent)", heard: "heard",
};

function renderTotals(totals) {
  const rows = Object.entries(TOTAL_LABELS).filter(([key]) => totals[key])
    .map(([key, label]) => cells([label, ms(totals[key].mean), ms(totals[key].max)]));
  $("totals").tBodies[0].replaceChildren(...rows);
}

// -- ended calls -------------------------------------------------------------------------

// Every instance's ended calls (the store's ended index), newest first, a page at a time.
const ended = { next: null, shown: 0 };

async function searchEnded(event, more = false) {
  if (event) event.preventDefault();
  if (!state.token) return;
  const params = { q: $("q").value, flow: $("flow").value, outcome: $("outcome").value,
    date: $("date").value, pii: pii(), before: more ? ended.next : "" };
  let data;
  try { data = await api(`/console/api/ended${query(params)}`); } catch (err) {
    $("ended-error").textContent = `Search failed: ${err.message}`;
    return;
  }
  $("ended-error").textContent = "";
  $("ended-partial").hidden = !data.partial;
  ended.next = data.next;
  ended.shown = (more ? ended.shown : 0) + data.calls.length;
  $("ended-count").textContent = `${ended.shown}${data.next ? "+" : ""}`;
  $("ended-more").hidden = !data.next;
  const body = $("ended-table").tBodies[0];
  const rows = data.calls.map((call) => {
    const when = call.ended_at ? shortTime(new Date(call.ended_at)) : "";
    const row = cells([when, call.caller, call.flow, call.outcome, duration(call.duration_s),
      String(call.turns), twilioStatus(call)]);
    row.cells[3].title = call.outcome_meaning;
    row.cells[3].className = `outcome ${call.outcome}`;
    row.dataset.sid = call.call_sid;
    row.addEventListener("click", () => selectCall(call.call_sid));
    return row;
  });
  if (more) body.append(...rows); else body.replaceChildren(...rows);
}

// -- small helpers -----------------------------------------------------------------------

function shortTime(date) {  // today: the time; earlier: the day too
  const today = new Date().toDateString() === date.toDateString();
  return today ? date.toLocaleTimeString() : date.toLocaleString();
}

function twilioStatus(call) {
  if (!call.twilio_status) return "";
  return call.billed_s === null || call.billed_s === undefined ? call.twilio_status
    : `${call.twilio_status}, ${call.billed_s} s`;
}

function el(tag, text) {
  const node = document.createElement(tag);
  if (text) node.textContent = text;
  return node;
}

function cells(values) {
  const row = document.createElement("tr");
  for (const value of values) row.append(el("td", value || ""));
  return row;
}

function ms(seconds) {
  return seconds === null || seconds === undefined ? "-" : `${Math.round(seconds * 1000)} ms`;
}

function duration(seconds) {
  const s = Math.max(0, Math.floor(seconds));
  return `${Math.floor(s / 60)}:${String(s % 60).padStart(2, "0")}`;
}

// -- wiring ------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    $("login-error").textContent = "";
    try { await signIn($("token").value.trim()); } catch (err) {
      if (!$("login-error").textContent) $("login-error").textContent = `Sign-in failed: ${err.message}`;
    }
  });
  $("logout").addEventListener("click", () => signOut());
  $("pii").addEventListener("change", () => {
    connect();
    searchEnded();
    if (state.selected) openCall(state.selected);
  });
  $("ended-form").addEventListener("submit", searchEnded);
  $("outcome").addEventListener("change", () => searchEnded());
  $("ended-more").addEventListener("click", () => searchEnded(null, true));
  $("open-sid").addEventListener("click", () => { if ($("sid").value) selectCall($("sid").value.trim()); });
  setInterval(tickDurations, 1000);
  if (state.token) signIn(state.token).catch(() => signOut());
});
