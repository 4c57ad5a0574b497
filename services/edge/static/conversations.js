// What the page knows: conversations, their messages, and the replies streaming on
// the socket (by chat id). No DOM and no socket here; frames go in, changes come out.

const TITLE_CHARS = 48;
const FINISHED = new Set(["stop", "length", "cancelled"]);
// A reply whose socket dropped and could not be resumed.
export const LOST = { code: "disconnected", message: "the connection dropped before the reply finished", retryable: true };

// One reply in flight. Keeps what a stream resume needs: the request id, the resume
// token (when the edge gives one) and the last seq shown.
export class ReplyStream {
  constructor(chatId) {
    this.chatId = chatId;
    this.requestId = null;
    this.resumeToken = null;
    this.lastSeq = -1;
    this.sent = false;
    // After its socket dropped: detached until the edge answers `resumed`; resumeSent
    // once the resume frame is out on a new socket; resumeBy is when the edge gives up.
    this.detached = false;
    this.resumeSent = false;
    this.resumeBy = 0;
    // For the reply's figures (performance.now() ms): when the chat went out, its first token came.
    this.sentAt = null;
    this.firstTokenAt = null;
  }

  get resumable() {
    return this.requestId !== null && this.resumeToken !== null;
  }

  // Waits for a socket to send its resume frame on.
  get awaitingSocket() {
    return this.detached && !this.resumeSent;
  }

  // True for the next token; false for one already shown (a duplicate).
  takes(seq) {
    if (seq <= this.lastSeq) return false;
    this.lastSeq = seq;
    return true;
  }
}

// What a finished reply shows about itself: time to first token (ms), tokens/s after the first,
// and the prompt tokens the worker found cached. A figure the frames cannot give is null.
export function replyStats(stream, usage, now) {
  const count = (value) => (Number.isInteger(value) && value >= 0 ? value : null);
  const completion = count(usage?.completion_tokens);
  const firstToken = stream.firstTokenAt;
  const ttftMs = stream.sentAt !== null && firstToken !== null ? firstToken - stream.sentAt : null;
  const decodeS = firstToken !== null ? (now - firstToken) / 1000 : 0;
  const tokensPerS = completion !== null && completion > 1 && decodeS > 0 ? (completion - 1) / decodeS : null;
  return {
    ttftMs,
    tokensPerS,
    promptTokens: count(usage?.prompt_tokens),
    cachedTokens: count(usage?.cached_tokens),
    completionTokens: completion,
  };
}

export class Message {
  constructor(role, text = "") {
    this.role = role; // "user" | "assistant"
    this.text = text;
    // assistant: "waiting" | "streaming" | "reconnecting" | "stop" | "length" | "cancelled" | "error"
    this.status = role === "user" ? "sent" : "waiting";
    this.error = null; // {code, message, retryable}
    this.stream = null; // ReplyStream while in flight
    this.stats = null; // replyStats() once done
  }

  get inFlight() {
    return this.stream !== null;
  }
}

export class Conversation {
  constructor(id) {
    this.id = id;
    this.messages = [];
  }

  get title() {
    const first = this.messages.find((m) => m.role === "user");
    if (!first) return "Untitled";
    const line = first.text.trim().replace(/\s+/g, " ");
    return line.length > TITLE_CHARS ? `${line.slice(0, TITLE_CHARS - 1)}…` : line;
  }

  get busy() {
    return this.messages.some((m) => m.inFlight);
  }

  // The conversation the model sees before `reply`: every user message and every
  // finished reply (a stopped one too: the user read it). Failed replies are left out.
  historyBefore(reply) {
    return this.messages
      .slice(0, this.messages.indexOf(reply))
      .filter((m) => m.role === "user" || (FINISHED.has(m.status) && m.text !== ""))
      .map((m) => ({ role: m.role, content: m.text }));
  }
}

export class ChatBook {
  constructor() {
    this.conversations = [];
    this.inFlight = new Map(); // chat id -> {conversation, reply}
    this.chatCount = 0;
  }

  newConversation() {
    const conversation = new Conversation(`conversation-${this.conversations.length + 1}`);
    this.conversations.unshift(conversation);
    return conversation;
  }

  find(conversationId) {
    return this.conversations.find((c) => c.id === conversationId) ?? null;
  }

  // The user's message and the (empty) reply that will answer it.
  ask(conversation, text) {
    conversation.messages.push(new Message("user", text));
    const reply = new Message("assistant");
    conversation.messages.push(reply);
    this.begin(conversation, reply);
    return reply;
  }

  // (Re)starts a reply under a fresh chat id; a retry reuses the reply's place.
  begin(conversation, reply) {
    reply.text = "";
    reply.status = "waiting";
    reply.error = null;
    reply.stats = null;
    reply.stream = new ReplyStream(`c${++this.chatCount}`);
    this.inFlight.set(reply.stream.chatId, { conversation, reply });
  }

  // params: the sampling fields of the chat frame; a non-empty system prompt goes first.
  chatFrame(conversation, reply, params, system = "") {
    const history = conversation.historyBefore(reply);
    const messages = system ? [{ role: "system", content: system }, ...history] : history;
    return { type: "chat", id: reply.stream.chatId, messages, ...params };
  }

  markSent(reply, now) {
    reply.stream.sent = true;
    reply.stream.sentAt ??= now;
  }

  unsent() {
    return [...this.inFlight.values()].filter(({ reply }) => !reply.stream.sent);
  }

  // Replies whose socket dropped, waiting for the next one to resume them on.
  awaitingSocket() {
    return [...this.inFlight.values()].filter(({ reply }) => reply.stream.awaitingSocket);
  }

  // The frame that picks a reply's stream up after the last token shown, under the same chat id.
  resumeFrame(reply) {
    const stream = reply.stream;
    return {
      type: "resume",
      id: stream.chatId,
      request_id: stream.requestId,
      resume_token: stream.resumeToken,
      last_seq: stream.lastSeq,
    };
  }

  // Applies one edge frame that arrived at `now` (ms). Returns {conversation, reply, text?} for
  // the reply it changed, or null when it belongs to no reply in flight (late or id-less frames).
  apply(frame, now = performance.now()) {
    const entry = this.inFlight.get(frame.id);
    if (!entry) return null;
    const { reply } = entry;
    const stream = reply.stream;
    switch (frame.type) {
      case "accepted":
        stream.requestId = frame.request_id ?? null;
        stream.resumeToken = frame.resume_token ?? null;
        return entry;
      case "resumed":
        if (!stream.detached || frame.request_id !== stream.requestId) return null;
        stream.detached = false;
        stream.resumeSent = false;
        reply.status = stream.lastSeq >= 0 ? "streaming" : "waiting";
        return entry;
      case "token":
        if (!Number.isInteger(frame.seq) || !stream.takes(frame.seq)) return null;
        reply.status = "streaming";
        stream.firstTokenAt ??= now;
        reply.text += String(frame.text ?? "");
        return { ...entry, text: String(frame.text ?? "") };
      case "done":
        reply.stats = replyStats(stream, frame.usage, now);
        return this.finish(frame.id, FINISHED.has(frame.finish_reason) ? frame.finish_reason : "stop");
      case "error":
        if (stream.detached && frame.code === "resume_refused") return this.finish(frame.id, "error", { ...LOST });
        return this.finish(frame.id, "error", {
          code: String(frame.code ?? "error"),
          message: String(frame.message ?? ""),
          retryable: frame.retryable === true,
        });
      default:
        return null;
    }
  }

  finish(chatId, status, error = null) {
    const entry = this.inFlight.get(chatId);
    if (!entry) return null;
    this.inFlight.delete(chatId);
    entry.reply.status = status;
    entry.reply.error = error;
    entry.reply.stream = null;
    return entry;
  }

  // The socket was closed on purpose: replies already sent are lost with it; unsent
  // ones wait for the next socket.
  failSent(error = LOST) {
    return [...this.inFlight.values()]
      .filter(({ reply }) => reply.stream.sent)
      .map(({ reply }) => this.finish(reply.stream.chatId, "error", { ...error }));
  }

  // The socket dropped: replies already sent wait, reconnecting, for a new socket to
  // resume them on until `resumeBy`; one the edge never accepted cannot be resumed and
  // fails. Unsent ones wait for the next socket as they are.
  detachSent(resumeBy) {
    return [...this.inFlight.values()]
      .filter(({ reply }) => reply.stream.sent)
      .map(({ reply }) => {
        const stream = reply.stream;
        if (!stream.resumable) return this.finish(stream.chatId, "error", { ...LOST });
        stream.detached = true;
        stream.resumeSent = false;
        stream.resumeBy = resumeBy;
        reply.status = "reconnecting";
        return this.inFlight.get(stream.chatId);
      });
  }

  // Replies still without a socket at `now`, past their grace: the edge has cancelled them.
  expireDetached(now) {
    return this.awaitingSocket()
      .filter(({ reply }) => reply.stream.resumeBy <= now)
      .map(({ reply }) => this.finish(reply.stream.chatId, "error", { ...LOST }));
  }
}
