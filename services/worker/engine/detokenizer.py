"""Token ids in, newly completed text out, one token at a time: never half a UTF-8 character,
never text past a stop string, and work per token that does not grow with the output."""

from shared.models.tokenizer import REPLACEMENT_CHAR, Tokenizer


class IncrementalDetokenizer:
    """Decodes only a short window of recent tokens per push.

    `prefix_offset:read_offset` is the window's already-emitted context (decoded again so
    that tokenizers which drop a leading space or merge bytes across tokens stay right);
    `read_offset:` are tokens whose text is not emitted yet.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.stopped = False
        self.stop_string: str | None = None  # which stop string ended the text
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.pending = ""  # decoded, but held back: it may be the start of a stop string
        # The longest held-back tail that is not yet a whole stop string.
        self._max_hold = max((len(s) - 1 for s in stop), default=0)

    def push(self, token_id: int) -> str:
        """Text that token_id completes; "" while a character or a possible stop string is unfinished."""
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        prefix_text = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self.tokenizer.decode(self.token_ids[self.prefix_offset :])
        # A trailing U+FFFD from a token the vocabulary has is an incomplete multi-byte character:
        # wait for the rest. (An out-of-vocabulary id decodes to U+FFFD for good.)
        incomplete = full_text.endswith(REPLACEMENT_CHAR) and 0 <= token_id < self.tokenizer.vocab_size
        if len(full_text) <= len(prefix_text) or incomplete:
            return ""
        new_text = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self._release(new_text, final=False)

    def flush(self) -> str:
        """At the end of the stream: everything still held back (an unfinished character as U+FFFD)."""
        if self.stopped:
            return ""
        prefix_text = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self.tokenizer.decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return self._release(full_text[len(prefix_text) :], final=True)

    def _release(self, new_text: str, final: bool) -> str:
        text = self.pending + new_text
        if self.stop:
            cut = self._find_stop(text)
            if cut is not None:
                self.stopped = True
                self.pending = ""
                return text[:cut]
        hold = 0 if final else self._held_tail(text)
        self.pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def _find_stop(self, text: str) -> int | None:
        """Index where the earliest stop string in text begins."""
        hits = [(i, s) for s in self.stop if (i := text.find(s)) >= 0]
        if not hits:
            return None
        index, self.stop_string = min(hits)
        return index

    def _held_tail(self, text: str) -> int:
        """Length of the longest tail of text that begins some stop string."""
        for n in range(min(self._max_hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
