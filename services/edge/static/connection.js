// The page's one WebSocket to the edge (/v1/chat): connects with the API key,
// reconnects when it drops, and tells a refused key from an unreachable edge.

const RECONNECT_DELAYS_MS = [500, 1000, 2000, 4000, 8000];
const HEALTH_TIMEOUT_MS = 3000;

export function chatUrl(apiKey, base = window.location.href) {
  const url = new URL("/v1/chat", base);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  url.searchParams.set("api_key", apiKey);
  return url.toString();
}

// A browser hides the handshake's HTTP status: a refused key (401) and an edge that
// is down both close with 1006 before `open`. If the edge answers its health check,
// the socket was refused, not lost.
async function edgeAnswers() {
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), HEALTH_TIMEOUT_MS);
  try {
    const response = await fetch("/healthz", { cache: "no-store", signal: abort.signal });
    return response.ok;
  } catch {
    return false;
  } finally {
    clearTimeout(timer);
  }
}

export class ChatConnection {
  // handlers: onState(state, detail), onOpen(), onFrame(frame), onLost(code, resumable), onRefused()
  // onLost's resumable is false when the page closed the socket itself (no reconnect follows).
  constructor(handlers) {
    this.handlers = handlers;
    this.apiKey = null;
    this.ws = null;
    this.attempt = 0;
    this.retryTimer = null;
    window.addEventListener("online", () => this.reconnectNow());
  }

  get isOpen() {
    return this.ws !== null && this.ws.readyState === WebSocket.OPEN;
  }

  start(apiKey) {
    this.stop();
    this.apiKey = apiKey;
    this.attempt = 0;
    this.open();
  }

  // Closes the socket on purpose (a new key): no reconnect.
  stop() {
    clearTimeout(this.retryTimer);
    this.retryTimer = null;
    const ws = this.ws;
    this.ws = null;
    if (ws) {
      const wasOpen = ws.readyState === WebSocket.OPEN;
      ws.close(1000, "closed by the page");
      if (wasOpen) this.handlers.onLost(1000, false);
    }
    this.handlers.onState("idle");
  }

  send(frame) {
    if (!this.isOpen) return false;
    this.ws.send(JSON.stringify(frame));
    return true;
  }

  reconnectNow() {
    if (this.retryTimer === null || this.apiKey === null) return;
    clearTimeout(this.retryTimer);
    this.retryTimer = null;
    this.open();
  }

  open() {
    this.retryTimer = null;
    const ws = new WebSocket(chatUrl(this.apiKey));
    this.ws = ws;
    let opened = false;
    this.handlers.onState("connecting");
    ws.addEventListener("open", () => {
      if (this.ws !== ws) return;
      opened = true;
      this.attempt = 0;
      this.handlers.onState("open");
      this.handlers.onOpen();
    });
    ws.addEventListener("message", (event) => {
      if (this.ws !== ws || typeof event.data !== "string") return;
      let frame;
      try {
        frame = JSON.parse(event.data);
      } catch {
        return; // the edge only sends JSON; anything else is not ours to show
      }
      this.handlers.onFrame(frame);
    });
    ws.addEventListener("close", (event) => {
      if (this.ws !== ws) return; // replaced or stopped on purpose
      this.ws = null;
      if (opened) {
        this.handlers.onLost(event.code, true);
        this.scheduleRetry();
      } else {
        this.failedBeforeOpen();
      }
    });
  }

  async failedBeforeOpen() {
    const apiKey = this.apiKey;
    const refused = await edgeAnswers();
    if (apiKey !== this.apiKey || this.ws !== null) return; // a new key arrived meanwhile
    if (refused) {
      this.apiKey = null;
      this.handlers.onState("refused");
      this.handlers.onRefused();
    } else {
      this.scheduleRetry();
    }
  }

  scheduleRetry() {
    const delay = RECONNECT_DELAYS_MS[Math.min(this.attempt, RECONNECT_DELAYS_MS.length - 1)];
    this.attempt += 1;
    this.handlers.onState("waiting", delay);
    this.retryTimer = setTimeout(() => this.open(), delay);
  }
}
