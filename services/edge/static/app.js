// Drivetrain's chat page: wires the conversations, the socket to the edge and the view.

import { ChatConnection } from "./connection.js";
import { ChatBook, LOST } from "./conversations.js";
import { ChatSettings, SettingsPanel } from "./settings.js";
import { ChatView } from "./view.js";

const KEY_STORAGE = "drivetrain.apiKey";
const REFUSED = "refused: check your API key";
// The edge's resume_grace_s (10 s by default): how long a dropped socket's streams wait.
const RESUME_GRACE_MS = 10_000;
const CLOSE_NOTICE = {
  1008: "The edge closed the connection: a message broke its rules.",
  1009: "The edge closed the connection: a message was too large.",
  1011: "The edge closed the connection after an internal error.",
  1013: "The edge is busy; reconnecting.",
};

const book = new ChatBook();
const settings = new ChatSettings();
new SettingsPanel(settings);
let active = book.newConversation();

function refresh() {
  view.renderSidebar(book.conversations, active.id);
  view.setBusy(active.busy);
}

// Sends a reply's chat frame now if the socket is open; otherwise it goes out on open.
function transmit(conversation, reply) {
  const frame = book.chatFrame(conversation, reply, settings.chatParams, settings.system);
  if (connection.send(frame)) book.markSent(reply, performance.now());
}

function conversationOf(message) {
  return book.conversations.find((c) => c.messages.includes(message)) ?? null;
}

// Replies that lost their socket fail once the edge no longer holds their streams.
function expireDetached() {
  for (const { reply } of book.expireDetached(Date.now())) view.updateMessage(reply);
  refresh();
}

function stopReply(reply) {
  const stream = reply.stream;
  if (stream.sent && !stream.awaitingSocket) {
    connection.send({ type: "cancel", id: stream.chatId }); // the edge answers with done: cancelled
  } else {
    book.finish(stream.chatId, "cancelled");
    view.updateMessage(reply);
  }
}

const view = new ChatView({
  send(text) {
    if (active.busy) return false;
    const reply = book.ask(active, text);
    const [question] = active.messages.slice(-2);
    view.addMessage(question);
    view.addMessage(reply);
    transmit(active, reply);
    refresh();
    return true;
  },
  stop() {
    active.messages.filter((m) => m.inFlight).forEach(stopReply);
    refresh();
  },
  retry(reply) {
    const conversation = conversationOf(reply);
    if (!conversation || reply.inFlight) return;
    book.begin(conversation, reply);
    view.resetMessage(reply);
    transmit(conversation, reply);
    refresh();
  },
  select(conversationId) {
    active = book.find(conversationId) ?? active;
    view.showConversation(active);
    refresh();
  },
  newConversation() {
    if (active.messages.length > 0) active = book.newConversation();
    view.showConversation(active);
    refresh();
  },
  useKey(key) {
    sessionStorage.setItem(KEY_STORAGE, key);
    connection.start(key);
  },
  changeKey() {
    view.askKey(null, false);
  },
});

const connection = new ChatConnection({
  onState(state) {
    view.setConnection(state);
  },
  onOpen() {
    view.notice(null);
    for (const { reply } of book.awaitingSocket()) {
      if (connection.send(book.resumeFrame(reply))) reply.stream.resumeSent = true;
    }
    for (const { conversation, reply } of book.unsent()) transmit(conversation, reply);
  },
  onFrame(frame) {
    if (frame.id === null || frame.id === undefined) {
      if (frame.type === "error") view.notice(`Error (${frame.code}): ${frame.message}`);
      return;
    }
    const change = book.apply(frame);
    if (!change) return;
    if (change.text !== undefined) view.appendText(change.reply, change.text);
    else view.updateMessage(change.reply);
    if (!change.reply.inFlight) refresh();
  },
  onLost(code, resumable) {
    const changed = resumable ? book.detachSent(Date.now() + RESUME_GRACE_MS) : book.failSent(LOST);
    for (const { reply } of changed) view.updateMessage(reply);
    if (resumable && changed.length > 0) setTimeout(expireDetached, RESUME_GRACE_MS + 100);
    if (CLOSE_NOTICE[code]) view.notice(CLOSE_NOTICE[code]);
    refresh();
  },
  onRefused() {
    sessionStorage.removeItem(KEY_STORAGE);
    view.askKey(REFUSED);
  },
});

view.showConversation(active);
refresh();
const savedKey = sessionStorage.getItem(KEY_STORAGE);
if (savedKey) connection.start(savedKey);
else view.askKey(null);
