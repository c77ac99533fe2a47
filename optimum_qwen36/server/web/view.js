// What the chat page shows (the conversation list, the messages, the composer and its images), drawn from
// app.js's `state` into its `ui` elements. Loaded before app.js, which starts the page. See docs/WEB_UI.md.
"use strict";

// ---------------------------------------------------------------- rendering

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function render() {
  renderConversationList();
  renderMessages();
  renderComposer();
}

function renderConversationList() {
  ui.conversationList.replaceChildren(
    ...state.conversations.map((conversation) => {
      const item = element("li", conversation.id === state.currentId ? "current" : "");
      const open = element("button", "conversation-title", conversation.title);
      open.type = "button";
      if (conversation.id === state.currentId) open.setAttribute("aria-current", "true");
      open.addEventListener("click", () => openConversation(conversation.id));
      const remove = element("button", "conversation-delete", "×");
      remove.type = "button";
      remove.setAttribute("aria-label", `Delete conversation: ${conversation.title}`);
      remove.addEventListener("click", () => deleteConversation(conversation.id));
      item.append(open, remove);
      return item;
    }),
  );
}

function renderMessages() {
  const conversation = currentConversation();
  const messages = conversation?.messages ?? [];
  const lastAnswer = messages.findLastIndex((m) => m.role === "assistant");
  ui.messages.replaceChildren(
    ...messages.map((message, index) => {
      if (message.role === "user") return userMessage(message);
      if (message.role === "tool") return textMessage("tool", `Result of ${message.name}`, message.content);
      const streaming = state.streaming?.message === message;
      const regenerable = index === lastAnswer && index === messages.length - 1 && !state.streaming;
      return assistantMessage(message, streaming, regenerable ? conversation : null);
    }),
  );
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

function textMessage(role, label, text) {
  const node = element("article", `message ${role}`);
  node.append(element("h3", "role", label), element("div", "content", text));
  return node;
}

function userMessage(message) {
  const node = textMessage("user", "You", message.content);
  if (message.images?.length) {
    const images = element("div", "images");
    images.append(...message.images.map((url) => imageElement(url, "Attached image")));
    node.querySelector(".content").before(images);
  }
  return node;
}

function imageElement(url, alt) {
  const image = element("img");
  image.src = url;
  image.alt = alt;
  return image;
}

// An assistant message: its reasoning (collapsible), content, tool calls, stats and error; `view` keeps the
// parts fillAssistant updates while the answer streams.
function assistantMessage(message, streaming, regenerable) {
  const node = element("article", "message assistant");
  const reasoning = element("details", "reasoning");
  const summary = element("summary", "", "Reasoning");
  const reasoningText = element("div", "reasoning-text");
  reasoning.append(summary, reasoningText);
  const view = {
    reasoning,
    summary,
    reasoningText,
    content: element("div", "content"),
    toolCalls: element("div", "tool-calls"),
    footer: element("footer"),
  };
  node.append(element("h3", "role", "Assistant"), reasoning, view.content, view.toolCalls, view.footer);
  node.view = view;
  fillAssistant(view, message, streaming);
  if (regenerable) {
    const again = element("button", "regenerate", "Regenerate");
    again.type = "button";
    again.addEventListener("click", () => regenerate(regenerable));
    view.footer.append(again);
  }
  return node;
}

function fillAssistant(view, message, streaming) {
  const thinking = streaming && !message.content && !message.tool_calls.length;
  view.reasoning.hidden = !message.reasoning;
  view.reasoningText.textContent = message.reasoning;
  view.summary.textContent = thinking ? "Thinking…" : "Reasoning";
  if (view.reasoning.dataset.thinking === "true" && !thinking) view.reasoning.open = false;
  if (thinking && view.reasoning.dataset.thinking !== "true") view.reasoning.open = true;
  view.reasoning.dataset.thinking = String(thinking);
  view.content.textContent = message.content;
  view.content.hidden = !message.content && !streaming;
  view.toolCalls.replaceChildren(...message.tool_calls.map(toolCallElement));
  if (!streaming) view.footer.replaceChildren(...footerParts(message));
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

function toolCallElement(call) {
  const node = element("div", "tool-call");
  let args = call.arguments;
  try {
    args = JSON.stringify(JSON.parse(args), null, 2);
  } catch {
    // still streaming, or not JSON: shown as written
  }
  node.append(element("div", "tool-name", `Tool call: ${call.name}`), element("pre", "tool-arguments", args));
  return node;
}

function footerParts(message) {
  const parts = [];
  if (message.error) parts.push(element("p", "error", message.error));
  if (message.stopped) parts.push(element("span", "stopped", "Stopped"));
  const { stats = {} } = message;
  const shown = [
    ["prompt", stats.promptTokens, (n) => `${n} prompt tokens`],
    ["cached", stats.cachedTokens, (n) => `${n} cached`],
    ["completion", stats.completionTokens, (n) => `${n} generated`],
    ["ttft", stats.ttft, (s) => `first token ${s.toFixed(2)} s`],
    ["speed", stats.tokensPerSecond, (r) => `${r.toFixed(1)} tokens/s`],
  ];
  const line = element("p", "stats");
  for (const [name, value, format] of shown) {
    if (value === undefined) continue;
    const stat = element("span", "stat", format(value));
    stat.dataset.stat = name;
    line.append(stat);
  }
  if (line.childElementCount) parts.push(line);
  return parts;
}

function renderComposer() {
  const streaming = Boolean(state.streaming);
  ui.stop.hidden = !streaming;
  ui.send.disabled = streaming;
  ui.messages.setAttribute("aria-busy", String(streaming));
  const call = pendingToolCall(currentConversation());
  ui.toolReply.hidden = !call;
  ui.toolReply.textContent = call ? `Your next message is the result of the tool call ${call.name}.` : "";
  ui.prompt.placeholder = call
    ? `Result of ${call.name} (JSON or text)`
    : "Message (Enter sends, Shift+Enter starts a new line)";
  ui.attach.hidden = !takesImages() || Boolean(call);
  renderAttachments();
}

// ---------------------------------------------------------------- images

function takesImages() {
  return Boolean(state.model?.input_modalities?.includes("image"));
}

function renderAttachments() {
  ui.attachments.hidden = !state.attachments.length;
  ui.attachments.replaceChildren(
    ...state.attachments.map((url, index) => {
      const item = element("li");
      const remove = element("button", "attachment-remove", "×");
      remove.type = "button";
      remove.setAttribute("aria-label", `Remove image ${index + 1}`);
      remove.addEventListener("click", () => {
        state.attachments.splice(index, 1);
        renderAttachments();
      });
      item.append(imageElement(url, `Image ${index + 1} to send`), remove);
      return item;
    }),
  );
}

// Attaches the image files among `files` (from the file input, a drop or a paste) as data: URLs.
async function attachFiles(files) {
  const images = [...files].filter((file) => file.type.startsWith("image/"));
  const others = [...files].filter((file) => !file.type.startsWith("image/"));
  if (images.length && !takesImages()) {
    showNotice("This model takes text only: images cannot be sent.");
    return;
  }
  if (images.length && pendingToolCall(currentConversation())) {
    showNotice("Images go in your messages, not in a tool call's result.");
    return;
  }
  showNotice(others.length ? `Not an image, left out: ${others.map((f) => f.name).join(", ")}.` : null);
  const urls = await Promise.all(images.map(dataURL));
  state.attachments.push(...urls);
  renderAttachments();
}

function dataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.addEventListener("load", () => resolve(reader.result));
    reader.addEventListener("error", () => reject(reader.error));
    reader.readAsDataURL(file);
  });
}

// The composer's notice: `text` (about the last attachment), else that storage is full, else none.
function showNotice(text) {
  if (text !== undefined) state.attachmentNotice = text;
  const full = state.storageFull
    ? "Local storage is full: this conversation is not saved and will be lost when the page closes. " +
      "Delete old conversations (images take the most room) to save again."
    : null;
  const shown = state.attachmentNotice ?? full;
  ui.composerNotice.hidden = !shown;
  ui.composerNotice.textContent = shown ?? "";
}
