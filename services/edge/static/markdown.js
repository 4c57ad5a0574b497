// Replies as Markdown: `marked` parses, DOMPurify sanitises what it made, then code blocks get a
// copy button. Raw HTML in a reply is never markup: marked's html tokens are rendered as escaped
// text, so a reply's `<b>` shows as the characters it is. Without the two libraries (the edge
// serves them from node_modules, /vendor/), replies are shown as plain text.

const COPIED_MS = 1500;

function escapeHtml(text) {
  return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
}

function makeParser() {
  const { marked, DOMPurify } = window;
  if (!marked?.Marked || !DOMPurify?.sanitize) return null;
  const parser = new marked.Marked({
    gfm: true,
    renderer: {
      html({ text, block }) {
        return block ? `<p>${escapeHtml(text.trim())}</p>\n` : escapeHtml(text);
      },
      // An image would be fetched from wherever the reply points; a link to it is shown instead.
      image({ href, text }) {
        return `<a href="${escapeHtml(href ?? "")}">${escapeHtml(text || href || "image")}</a>`;
      },
    },
  });
  const purifier = DOMPurify(window);
  purifier.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A" && node.hasAttribute("href")) {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });
  return (text) => purifier.sanitize(parser.parse(text).trim(), { USE_PROFILES: { html: true } });
}

const toHtml = makeParser();
export const markdownAvailable = toHtml !== null;

async function copyText(text) {
  if (navigator.clipboard?.writeText) {
    try {
      await navigator.clipboard.writeText(text);
      return true;
    } catch {
      // refused (no permission, not a secure context): fall back to a selection
    }
  }
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.className = "visually-hidden";
  document.body.append(area);
  area.select();
  const copied = document.execCommand("copy");
  area.remove();
  return copied;
}

function addCopyButtons(container) {
  for (const pre of container.querySelectorAll("pre")) {
    const block = document.createElement("div");
    block.className = "code-block";
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy";
    copy.textContent = "Copy";
    copy.setAttribute("aria-label", "Copy code");
    copy.addEventListener("click", async () => {
      const copied = await copyText(pre.textContent);
      copy.textContent = copied ? "Copied" : "Copy failed";
      setTimeout(() => (copy.textContent = "Copy"), COPIED_MS);
    });
    pre.replaceWith(block);
    block.append(copy, pre);
  }
}

// Shows `text` in `container`: rendered Markdown when the libraries are here, else plain text.
export function renderInto(container, text) {
  if (!toHtml) {
    container.textContent = text;
    return;
  }
  container.innerHTML = toHtml(text);
  addCopyButtons(container);
}
