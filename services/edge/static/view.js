// The page's DOM: sidebar, messages, composer, key dialog and connection state.
// A user's text goes in through textContent; a reply through markdown.js (sanitised Markdown,
// raw HTML escaped) or, without its libraries, textContent too. Never as markup of its own.

import { renderInto } from "./markdown.js";

const CONNECTION_TEXT = {
  idle: "Not connected",
  connecting: "Connecting…",
  open: "Connected",
  waiting: "Reconnecting…",
  refused: "Key refused",
};
const FINISH_TEXT = { cancelled: "Stopped", length: "Cut off at the length limit" };
const STICK_TO_BOTTOM_PX = 80;

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function formatRate(perS) {
  return perS >= 100 ? perS.toFixed(0) : perS.toFixed(1);
}

// A finished reply's figures, each a span with its meaning spelled out for a screen reader.
function statsFor(stats) {
  if (!stats) return [];
  const parts = [];
  if (stats.ttftMs !== null) parts.push(["ttft", `${Math.round(stats.ttftMs)} ms to first token`]);
  if (stats.tokensPerS !== null) parts.push(["rate", `${formatRate(stats.tokensPerS)} tokens/s`]);
  if (stats.cachedTokens !== null) {
    const of = stats.promptTokens !== null ? ` of ${stats.promptTokens}` : "";
    parts.push(["cached", `${stats.cachedTokens}${of} prompt tokens cached`]);
  }
  return parts.map(([kind, text]) => element("span", `stat ${kind}`, text));
}

export class ChatView {
  // actions: send(text) -> bool, stop(), retry(reply), select(id), newConversation(), useKey(key), changeKey()
  constructor(actions) {
    this.actions = actions;
    this.nodes = new WeakMap(); // Message -> {article, body, meta, stats}
    this.toRender = new Set(); // replies whose text changed since the last frame was drawn
    this.renderScheduled = false;
    this.keyRequired = false;
    for (const id of ["sidebar", "toggle-sidebar", "connection", "conversation-list", "messages",
      "composer", "prompt", "send", "stop", "key-dialog", "key-form", "key-error", "api-key"]) {
      this[id.replace(/-(\w)/g, (_, c) => c.toUpperCase())] = document.getElementById(id);
    }
    this.noticeBox = document.getElementById("notice");
    this.wire();
  }

  wire() {
    document.getElementById("new-conversation").addEventListener("click", () => {
      this.actions.newConversation();
      this.setSidebarOpen(false);
      this.prompt.focus();
    });
    document.getElementById("change-key").addEventListener("click", () => this.actions.changeKey());
    this.toggleSidebar.addEventListener("click", () => this.setSidebarOpen(this.sidebar.dataset.open !== "true"));
    this.sidebar.addEventListener("keydown", (event) => {
      if (event.key === "Escape" && this.sidebar.dataset.open === "true") {
        this.setSidebarOpen(false);
        this.toggleSidebar.focus();
      }
    });
    this.composer.addEventListener("submit", (event) => {
      event.preventDefault();
      const text = this.prompt.value.trim();
      if (text && this.actions.send(text)) {
        this.prompt.value = "";
        this.fitPrompt();
      }
    });
    this.prompt.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.composer.requestSubmit();
      }
    });
    this.prompt.addEventListener("input", () => this.fitPrompt());
    this.stop.addEventListener("click", () => this.actions.stop());
    this.keyForm.addEventListener("submit", (event) => {
      event.preventDefault();
      const key = this.apiKey.value.trim();
      if (!key) return;
      this.keyRequired = false;
      this.keyDialog.close();
      this.actions.useKey(key);
    });
    this.keyDialog.addEventListener("cancel", (event) => {
      if (this.keyRequired) event.preventDefault(); // no key, nothing to go back to
    });
  }

  fitPrompt() {
    this.prompt.style.height = "auto";
    this.prompt.style.height = `${Math.min(this.prompt.scrollHeight, 200)}px`;
  }

  setSidebarOpen(open) {
    this.sidebar.dataset.open = String(open);
    this.toggleSidebar.setAttribute("aria-expanded", String(open));
  }

  askKey(problem, required = true) {
    this.keyRequired = required;
    this.keyError.textContent = problem ?? "";
    this.keyError.hidden = !problem;
    this.apiKey.value = "";
    if (!this.keyDialog.open) this.keyDialog.showModal();
    this.apiKey.focus();
  }

  setConnection(state) {
    this.connection.dataset.state = state;
    this.connection.querySelector(".connection-text").textContent = CONNECTION_TEXT[state] ?? state;
  }

  notice(text) {
    this.noticeBox.textContent = text ?? "";
    this.noticeBox.hidden = !text;
  }

  renderSidebar(conversations, activeId) {
    const items = conversations.map((conversation) => {
      const button = element("button", "conversation");
      button.type = "button";
      button.append(element("span", "title", conversation.title));
      button.dataset.conversation = conversation.id;
      if (conversation.id === activeId) button.setAttribute("aria-current", "true");
      if (conversation.busy) {
        const live = element("span", "live-dot");
        live.setAttribute("role", "img");
        live.setAttribute("aria-label", "replying");
        button.append(live);
      }
      button.addEventListener("click", () => {
        this.actions.select(conversation.id);
        this.setSidebarOpen(false);
      });
      const item = element("li");
      item.append(button);
      return item;
    });
    this.conversationList.replaceChildren(...items);
  }

  showConversation(conversation) {
    this.messages.replaceChildren();
    if (conversation.messages.length === 0) {
      this.messages.append(element("p", "empty", "Ask anything. Replies stream in as they are written."));
    }
    for (const message of conversation.messages) this.addMessage(message);
    this.setBusy(conversation.busy);
    this.messages.scrollTop = this.messages.scrollHeight;
  }

  addMessage(message) {
    this.messages.querySelector(":scope > .empty")?.remove();
    const article = element("article", `message ${message.role}`);
    const who = element("h2", message.role === "user" ? "visually-hidden" : "who", message.role === "user" ? "You" : "Drivetrain");
    const assistant = message.role === "assistant";
    const body = element("div", assistant ? "body markdown" : "body", assistant ? undefined : message.text);
    if (assistant) renderInto(body, message.text);
    const meta = element("div", "meta");
    const stats = element("div", "stats");
    article.append(who, body, meta, stats);
    this.nodes.set(message, { article, body, meta, stats });
    this.messages.append(article);
    this.updateMessage(message);
    this.messages.scrollTop = this.messages.scrollHeight;
  }

  appendText(message, text) {
    const nodes = this.nodes.get(message);
    if (!nodes) return; // its conversation is not on screen
    this.toRender.add(message);
    this.updateMessage(message);
    if (!this.renderScheduled) {
      this.renderScheduled = true;
      requestAnimationFrame(() => this.renderPending());
    }
  }

  // Re-renders each changed reply once per drawn frame, however many tokens came meanwhile.
  renderPending() {
    this.renderScheduled = false;
    const stick = this.nearBottom();
    for (const message of this.toRender) this.renderText(message);
    if (stick) this.messages.scrollTop = this.messages.scrollHeight;
  }

  renderText(message) {
    this.toRender.delete(message);
    const nodes = this.nodes.get(message);
    if (nodes) renderInto(nodes.body, message.text);
  }

  // A retried reply starts over: its shown text is cleared with it.
  resetMessage(message) {
    this.renderText(message);
    this.updateMessage(message);
  }

  updateMessage(message) {
    const nodes = this.nodes.get(message);
    if (!nodes) return;
    nodes.article.dataset.status = message.status;
    nodes.article.setAttribute("aria-busy", String(message.inFlight));
    if (message.role === "user") return;
    if (!message.inFlight && this.toRender.has(message)) this.renderText(message); // its final text now
    nodes.meta.replaceChildren(...this.metaFor(message));
    nodes.stats.replaceChildren(...statsFor(message.stats));
  }

  metaFor(message) {
    if (message.status === "waiting") {
      const typing = element("span", "typing");
      typing.setAttribute("role", "img");
      typing.setAttribute("aria-label", "Waiting for the reply");
      typing.append(element("span"), element("span"), element("span"));
      return [typing];
    }
    if (message.status === "reconnecting") {
      return [element("span", "reconnecting", "Reconnecting…")];
    }
    if (message.status === "error") {
      const { code, message: why, retryable } = message.error;
      const parts = [element("span", "error-text", `Error (${code})${why ? `: ${why}` : ""}`)];
      if (retryable) {
        const retry = element("button", "retry", "Retry");
        retry.type = "button";
        retry.addEventListener("click", () => this.actions.retry(message));
        parts.push(retry);
      }
      return parts;
    }
    const finish = FINISH_TEXT[message.status];
    return finish ? [element("span", `finish ${message.status}`, finish)] : [];
  }

  setBusy(busy) {
    if (!busy && document.activeElement === this.stop) this.prompt.focus();
    this.send.hidden = busy;
    this.stop.hidden = !busy;
    this.messages.setAttribute("aria-busy", String(busy));
  }

  nearBottom() {
    const m = this.messages;
    return m.scrollHeight - m.scrollTop - m.clientHeight < STICK_TO_BOTTOM_PX;
  }
}
