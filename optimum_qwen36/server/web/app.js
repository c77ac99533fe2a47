// The chat page of `optimum-qwen36 serve`: a plain OpenAI client of this server (GET /v1/models, POST
// /v1/chat/completions streamed). Conversations and settings stay in this browser's localStorage, the API
// key (asked for only when the server answers 401) in this tab's sessionStorage. Images (dropped, pasted or
// attached, when the model takes them) go as data: URLs in the user message's content parts. view.js draws
// the page. No framework and no build step: the files the server ships are the files that run. See
// docs/WEB_UI.md.
"use strict";

const STORAGE_KEYS = {
  conversations: "optimum-qwen36.conversations",
  currentConversation: "optimum-qwen36.current-conversation",
  settings: "optimum-qwen36.settings",
  apiKey: "optimum-qwen36.api-key",
};
const DEFAULT_SETTINGS = {
  systemPrompt: "",
  temperature: "",
  topP: "",
  maxTokens: "",
  tools: "",
  thinking: null, // null until the switch is used: the server's --default-enable-thinking
};
const TITLE_LENGTH = 48;
const MODEL_RETRY_MS = 2000; // /v1/models answers 503 while the server still loads the model
const SERVER_THINKING = document.querySelector('meta[name="default-enable-thinking"]').content === "true";

const $ = (id) => document.getElementById(id);
const ui = {
  newChat: $("new-chat"),
  conversationList: $("conversation-list"),
  modelName: $("model-name"),
  modelContext: $("model-context"),
  settingsToggle: $("settings-toggle"),
  settings: $("settings"),
  settingsModel: $("settings-model"),
  settingsContext: $("settings-context"),
  systemPrompt: $("system-prompt"),
  temperature: $("temperature"),
  topP: $("top-p"),
  maxTokens: $("max-tokens"),
  tools: $("tools"),
  toolsError: $("tools-error"),
  messages: $("messages"),
  composer: $("composer"),
  toolReply: $("tool-reply"),
  composerNotice: $("composer-notice"),
  attachments: $("attachments"),
  attach: $("attach"),
  imageInput: $("image-input"),
  prompt: $("prompt"),
  thinking: $("thinking"),
  stop: $("stop"),
  send: $("send"),
  keyDialog: $("key-dialog"),
  keyForm: $("key-form"),
  keyRefused: $("key-refused"),
  apiKey: $("api-key"),
  keyCancel: $("key-cancel"),
};

const state = {
  model: null, // the served model's card from /v1/models: {id, max_model_len, ...}
  conversations: readJSON(localStorage, STORAGE_KEYS.conversations, []),
  currentId: localStorage.getItem(STORAGE_KEYS.currentConversation),
  settings: { ...DEFAULT_SETTINGS, ...readJSON(localStorage, STORAGE_KEYS.settings, {}) },
  streaming: null, // while an answer streams: {controller, conversation, message}
  keyPrompt: null, // the pending API key question, shared by the requests that met a 401
  attachments: [], // data: URLs of the images the next message carries
  storageFull: false, // the last save of the conversations did not fit in localStorage
  attachmentNotice: null, // why the last images given were not attached
};

// ---------------------------------------------------------------- storage

function readJSON(storage, key, fallback) {
  try {
    const text = storage.getItem(key);
    return text === null ? fallback : JSON.parse(text);
  } catch {
    return fallback; // a value another version of this page wrote, or a hand edit: start afresh
  }
}

// Images make conversations large: when localStorage is full, the page goes on (the conversations live in
// memory until it is closed) and says so.
function saveConversations() {
  try {
    localStorage.setItem(STORAGE_KEYS.conversations, JSON.stringify(state.conversations));
    localStorage.setItem(STORAGE_KEYS.currentConversation, state.currentId ?? "");
    state.storageFull = false;
  } catch (error) {
    if (error.name !== "QuotaExceededError") throw error;
    state.storageFull = true;
  }
  showNotice();
}

function saveSettings() {
  localStorage.setItem(STORAGE_KEYS.settings, JSON.stringify(state.settings));
}

// ---------------------------------------------------------------- conversations

function currentConversation() {
  return state.conversations.find((c) => c.id === state.currentId) ?? null;
}

function startConversation() {
  const conversation = {
    id: `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`,
    title: "New chat",
    updated: Date.now(),
    messages: [],
  };
  state.conversations.unshift(conversation);
  state.currentId = conversation.id;
  return conversation;
}

function openConversation(id) {
  stopAnswer(); // the answer being streamed belongs to the conversation left
  state.currentId = id;
  saveConversations();
  render();
}

function deleteConversation(id) {
  if (state.streaming?.conversation.id === id) stopAnswer();
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (state.currentId === id) state.currentId = state.conversations[0]?.id ?? null;
  saveConversations();
  render();
}

function touch(conversation) {
  conversation.updated = Date.now();
  const first = conversation.messages.find((m) => m.role === "user");
  if (first) conversation.title = (first.content || "Image").slice(0, TITLE_LENGTH);
  state.conversations.sort((a, b) => b.updated - a.updated);
}

// The tool call of the last assistant message that has no result yet: the composer then sends its result.
function pendingToolCall(conversation) {
  const messages = conversation?.messages ?? [];
  const last = messages.findLastIndex((m) => m.role === "assistant");
  if (last < 0 || !messages[last].tool_calls?.length || messages[last].stopped) return null;
  const answered = new Set(messages.slice(last + 1).map((m) => m.tool_call_id));
  return messages[last].tool_calls.find((call) => !answered.has(call.id)) ?? null;
}

// ---------------------------------------------------------------- requests

function authorizationHeaders() {
  const key = sessionStorage.getItem(STORAGE_KEYS.apiKey);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// fetch() against this server; a 401 asks for the API key (once for all the requests that met it) and
// retries with it. Cancelling the question returns the 401 response.
async function apiFetch(path, options = {}) {
  for (;;) {
    const headers = { "Content-Type": "application/json", ...authorizationHeaders() };
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401) return response;
    const refused = Boolean(sessionStorage.getItem(STORAGE_KEYS.apiKey));
    if (!(await askForApiKey(refused))) return response;
  }
}

function askForApiKey(refused) {
  if (state.keyPrompt) return state.keyPrompt;
  ui.keyRefused.hidden = !refused;
  ui.apiKey.value = "";
  ui.keyDialog.showModal();
  state.keyPrompt = new Promise((resolve) => {
    const finish = (key) => {
      ui.keyForm.removeEventListener("submit", submit);
      ui.keyCancel.removeEventListener("click", cancel);
      ui.keyDialog.removeEventListener("cancel", cancel);
      ui.keyDialog.close();
      state.keyPrompt = null;
      if (key) sessionStorage.setItem(STORAGE_KEYS.apiKey, key);
      resolve(Boolean(key));
    };
    const submit = (event) => {
      event.preventDefault();
      finish(ui.apiKey.value.trim());
    };
    const cancel = (event) => {
      event.preventDefault();
      finish(null);
    };
    ui.keyForm.addEventListener("submit", submit);
    ui.keyCancel.addEventListener("click", cancel);
    ui.keyDialog.addEventListener("cancel", cancel); // Escape
  });
  return state.keyPrompt;
}

async function errorMessage(response) {
  try {
    return (await response.json()).error.message;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

async function loadModel() {
  let response;
  try {
    response = await apiFetch("/v1/models");
  } catch {
    response = null; // the server is not up (yet)
  }
  if (response?.status === 401) {
    ui.modelContext.textContent = "API key needed"; // asked again when a message is sent
    return;
  }
  if (!response?.ok) {
    ui.modelContext.textContent = "waiting for the model…";
    setTimeout(loadModel, MODEL_RETRY_MS);
    return;
  }
  state.model = (await response.json()).data[0];
  renderComposer(); // image attachment, if the model takes images
  const context = `context ${state.model.max_model_len.toLocaleString("en")} tokens`;
  ui.modelName.textContent = state.model.id;
  ui.modelContext.textContent = context;
  ui.settingsModel.textContent = state.model.id;
  ui.settingsContext.textContent = `${state.model.max_model_len.toLocaleString("en")} tokens`;
  document.title = `${state.model.id} · optimum-qwen36`;
}

// The tools setting as the request's `tools`: a JSON array of OpenAI function tools (one tool alone is
// taken as a list of one). Throws with a message a user can act on.
function parseTools(text) {
  if (!text.trim()) return [];
  let tools;
  try {
    tools = JSON.parse(text);
  } catch (error) {
    throw new Error(`Tools: not valid JSON (${error.message}).`);
  }
  return Array.isArray(tools) ? tools : [tools];
}

// A message as the API takes it: the page's own fields (reasoning, stats, ...) stay in the page. Reasoning
// is not sent back, as OpenAI clients do: the chat template decides what earlier turns show.
function apiMessage(message) {
  if (message.role === "tool") {
    return { role: "tool", tool_call_id: message.tool_call_id, content: message.content };
  }
  if (message.role === "assistant" && message.tool_calls?.length) {
    const calls = message.tool_calls.map(({ id, name, arguments: args }) => ({
      id,
      type: "function",
      function: { name, arguments: args },
    }));
    return { role: "assistant", content: message.content || null, tool_calls: calls };
  }
  if (message.images?.length) {
    const images = message.images.map((url) => ({ type: "image_url", image_url: { url } }));
    return { role: message.role, content: [{ type: "text", text: message.content }, ...images] };
  }
  return { role: message.role, content: message.content };
}

function chatRequest(conversation) {
  const { settings } = state;
  const history = conversation.messages.filter((m) => !(m.role === "assistant" && m.error));
  const messages = history.map(apiMessage);
  if (settings.systemPrompt.trim()) messages.unshift({ role: "system", content: settings.systemPrompt });
  const body = {
    model: state.model?.id,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    chat_template_kwargs: { enable_thinking: settings.thinking ?? SERVER_THINKING },
  };
  const numbers = { temperature: settings.temperature, top_p: settings.topP, max_tokens: settings.maxTokens };
  for (const [field, value] of Object.entries(numbers)) {
    if (value !== "") body[field] = Number(value);
  }
  const tools = parseTools(settings.tools);
  if (tools.length) body.tools = tools;
  return body;
}

// The JSON payloads of a server-sent event stream, up to `data: [DONE]`.
async function* serverEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

// ---------------------------------------------------------------- answering

function send(text, images) {
  let conversation = currentConversation() ?? startConversation();
  const call = pendingToolCall(conversation);
  const user = images.length ? { role: "user", content: text, images } : { role: "user", content: text };
  conversation.messages.push(
    call ? { role: "tool", tool_call_id: call.id, name: call.name, content: text } : user,
  );
  touch(conversation);
  answer(conversation);
}

function regenerate(conversation) {
  const last = conversation.messages.findLastIndex((m) => m.role !== "assistant");
  conversation.messages.splice(last + 1);
  answer(conversation);
}

async function answer(conversation) {
  const message = { role: "assistant", content: "", reasoning: "", tool_calls: [] };
  let body;
  try {
    body = chatRequest(conversation);
  } catch (error) {
    message.error = error.message;
  }
  conversation.messages.push(message);
  saveConversations();
  if (message.error) {
    render();
    return;
  }
  const controller = new AbortController();
  state.streaming = { controller, conversation, message };
  render();
  const view = ui.messages.lastElementChild.view;
  const started = performance.now();
  let firstTokenAt = null;
  let usage = null;
  try {
    const options = { method: "POST", body: JSON.stringify(body), signal: controller.signal };
    const response = await apiFetch("/v1/chat/completions", options);
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const chunk of serverEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      usage = chunk.usage ?? usage;
      for (const choice of chunk.choices) {
        if (addDelta(message, choice.delta) && firstTokenAt === null) firstTokenAt = performance.now();
        message.finish_reason = choice.finish_reason ?? message.finish_reason;
      }
      fillAssistant(view, message, true);
    }
  } catch (error) {
    if (error.name === "AbortError") message.stopped = true;
    else message.error = error.message;
  }
  message.stats = answerStats(started, firstTokenAt, performance.now(), usage);
  if (state.streaming?.controller === controller) state.streaming = null;
  touch(conversation);
  saveConversations();
  render();
}

// Adds a stream delta to the message; true if it carried generated text.
function addDelta(message, delta) {
  const reasoning = delta.reasoning ?? delta.reasoning_content ?? "";
  message.reasoning += reasoning;
  message.content += delta.content ?? "";
  for (const part of delta.tool_calls ?? []) {
    if (part.id) message.tool_calls[part.index] = { id: part.id, name: part.function.name, arguments: "" };
    message.tool_calls[part.index].arguments += part.function?.arguments ?? "";
  }
  return Boolean(reasoning || delta.content || delta.tool_calls?.length);
}

// What the answer's footer shows: token counts from the usage chunk (absent when stopped), the time to the
// first token and the generation speed after it.
function answerStats(started, firstTokenAt, ended, usage) {
  const stats = {};
  if (firstTokenAt !== null) stats.ttft = (firstTokenAt - started) / 1000;
  if (usage) {
    stats.promptTokens = usage.prompt_tokens;
    stats.cachedTokens = usage.prompt_tokens_details?.cached_tokens ?? 0;
    stats.completionTokens = usage.completion_tokens;
    const seconds = (ended - firstTokenAt) / 1000;
    if (firstTokenAt !== null && usage.completion_tokens > 1 && seconds > 0) {
      stats.tokensPerSecond = (usage.completion_tokens - 1) / seconds;
    }
  }
  return stats;
}

function stopAnswer() {
  state.streaming?.controller.abort();
}

// ---------------------------------------------------------------- settings

const SETTING_INPUTS = {
  systemPrompt: ui.systemPrompt,
  temperature: ui.temperature,
  topP: ui.topP,
  maxTokens: ui.maxTokens,
  tools: ui.tools,
};

function showSettings() {
  for (const [name, input] of Object.entries(SETTING_INPUTS)) {
    input.value = state.settings[name];
    input.addEventListener("input", () => {
      state.settings[name] = input.value;
      saveSettings();
      if (name === "tools") checkTools();
    });
  }
  ui.thinking.checked = state.settings.thinking ?? SERVER_THINKING;
  ui.thinking.addEventListener("change", () => {
    state.settings.thinking = ui.thinking.checked;
    saveSettings();
  });
  checkTools();
}

function checkTools() {
  try {
    parseTools(state.settings.tools);
    ui.toolsError.hidden = true;
  } catch (error) {
    ui.toolsError.textContent = error.message;
    ui.toolsError.hidden = false;
  }
}

// ---------------------------------------------------------------- events

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.prompt.value.trim();
  const images = pendingToolCall(currentConversation()) ? [] : state.attachments;
  if ((!text && !images.length) || state.streaming) return;
  ui.prompt.value = "";
  if (images.length) state.attachments = [];
  showNotice(null);
  send(text, images);
});

ui.imageInput.addEventListener("change", () => {
  attachFiles(ui.imageInput.files);
  ui.imageInput.value = ""; // the same file can be chosen again
});

ui.prompt.addEventListener("paste", (event) => {
  const files = [...event.clipboardData.files];
  if (!files.length) return; // text: pasted as usual
  event.preventDefault();
  attachFiles(files);
});

ui.composer.addEventListener("dragover", (event) => {
  if (!event.dataTransfer.types.includes("Files")) return;
  event.preventDefault();
  ui.composer.classList.add("dropping");
});

ui.composer.addEventListener("dragleave", () => ui.composer.classList.remove("dropping"));

ui.composer.addEventListener("drop", (event) => {
  ui.composer.classList.remove("dropping");
  if (!event.dataTransfer.files.length) return;
  event.preventDefault();
  attachFiles(event.dataTransfer.files);
});

// A file dropped beside the composer is not opened in place of the page.
for (const type of ["dragover", "drop"]) {
  window.addEventListener(type, (event) => {
    if (event.dataTransfer.types.includes("Files")) event.preventDefault();
  });
}

ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    ui.composer.requestSubmit();
  }
});

ui.stop.addEventListener("click", stopAnswer);

ui.newChat.addEventListener("click", () => {
  stopAnswer();
  if (currentConversation()?.messages.length !== 0) startConversation();
  saveConversations();
  render();
  ui.prompt.focus();
});

ui.settingsToggle.addEventListener("click", () => {
  ui.settings.hidden = !ui.settings.hidden;
  ui.settingsToggle.setAttribute("aria-expanded", String(!ui.settings.hidden));
});

showSettings();
render();
loadModel();
