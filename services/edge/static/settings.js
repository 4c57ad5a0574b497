// The page's chat settings: temperature, max tokens and a system prompt, kept in the browser
// (local storage) and edited in a dialog. What goes into a chat frame is checked here once.

const STORAGE = "drivetrain.chatSettings";
export const DEFAULTS = Object.freeze({ temperature: 0.7, maxTokens: 1024, system: "" });
const LIMITS = { temperature: [0, 2], maxTokens: [1, 32768] };

// A stored or typed value as the setting it names, or its default when it is not one.
function cleanNumber(value, [low, high], fallback, integer) {
  const number = typeof value === "number" ? value : Number.parseFloat(value);
  if (!Number.isFinite(number) || number < low || number > high) return fallback;
  return integer ? Math.round(number) : number;
}

export function cleanSettings(raw) {
  return {
    temperature: cleanNumber(raw?.temperature, LIMITS.temperature, DEFAULTS.temperature, false),
    maxTokens: cleanNumber(raw?.maxTokens, LIMITS.maxTokens, DEFAULTS.maxTokens, true),
    system: typeof raw?.system === "string" ? raw.system.trim() : DEFAULTS.system,
  };
}

export class ChatSettings {
  constructor(storage = window.localStorage) {
    this.storage = storage;
    let stored = null;
    try {
      stored = JSON.parse(storage.getItem(STORAGE) ?? "null");
    } catch {
      stored = null; // not ours, or from an older page: defaults
    }
    this.values = cleanSettings(stored ?? DEFAULTS);
  }

  update(raw) {
    this.values = cleanSettings(raw);
    this.storage.setItem(STORAGE, JSON.stringify(this.values));
  }

  // The sampling fields of a chat frame.
  get chatParams() {
    return { max_tokens: this.values.maxTokens, temperature: this.values.temperature };
  }

  get system() {
    return this.values.system;
  }
}

// The settings dialog: filled from the settings when opened, saved on "Save".
export class SettingsPanel {
  constructor(settings) {
    this.settings = settings;
    this.dialog = document.getElementById("settings-dialog");
    this.form = document.getElementById("settings-form");
    this.fields = {
      temperature: document.getElementById("setting-temperature"),
      maxTokens: document.getElementById("setting-max-tokens"),
      system: document.getElementById("setting-system"),
    };
    this.fields.temperature.min = LIMITS.temperature[0];
    this.fields.temperature.max = LIMITS.temperature[1];
    this.fields.maxTokens.min = LIMITS.maxTokens[0];
    this.fields.maxTokens.max = LIMITS.maxTokens[1];
    document.getElementById("open-settings").addEventListener("click", () => this.open());
    document.getElementById("settings-cancel").addEventListener("click", () => this.dialog.close());
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.settings.update({
        temperature: this.fields.temperature.value,
        maxTokens: this.fields.maxTokens.value,
        system: this.fields.system.value,
      });
      this.dialog.close();
    });
  }

  open() {
    const { temperature, maxTokens, system } = this.settings.values;
    this.fields.temperature.value = String(temperature);
    this.fields.maxTokens.value = String(maxTokens);
    this.fields.system.value = system;
    this.dialog.showModal();
    this.fields.temperature.focus();
  }
}
