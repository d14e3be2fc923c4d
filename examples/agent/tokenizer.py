"""A small greedy longest-match subword tokenizer with role markers.

``encode`` is canonical (longest match left to right); a policy may emit any other segmentation of
the same text (e.g. ``b``,``o``,``o``,``k`` for ``book``), so ``encode(decode(ids)) != ids`` in
general: exactly the case where re-tokenizing a conversation history changes the tokens the policy
was scored on. Trajectories therefore store the ids they were given and never re-encode history.
"""

from __future__ import annotations

SPECIALS = ("<pad>", "<s>", "<system>", "<user>", "<agent>", "<tool>", "</turn>")
WORDS = ("booking", "book", "flight", "flights", "change", "cancel", "refund", "search", "get_", "call ",
         "say ", "done", "confirm", "please", "the ", "to ", "my ", "on ", "for ", "is ", "you", "thank",
         "seat", "date", "from ", "price", "status", "active", "cancelled", "error", "ok", "day", "want")


class ToyTokenizer:
    """Specials (ids 0..6), printable ASCII characters, then multi-character pieces ``WORDS``."""

    def __init__(self) -> None:
        pieces = list(SPECIALS) + [chr(c) for c in range(32, 127)] + list(WORDS)
        self.pieces = pieces
        self.ids = {p: i for i, p in enumerate(pieces)}
        self._max = max(len(p) for p in pieces[len(SPECIALS):])
        self.pad_id, self.bos_id, self.eot_id = 0, 1, self.ids["</turn>"]
        self.role_ids = {r: self.ids[f"<{r}>"] for r in ("system", "user", "agent", "tool")}

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Greedy longest match over the non-special pieces. Raises ``ValueError`` naming a
        character outside printable ASCII."""
        out, i, n = [], 0, len(text)
        while i < n:
            for k in range(min(self._max, n - i), 0, -1):
                tid = self.ids.get(text[i:i + k])
                if tid is not None and tid >= len(SPECIALS):
                    out.append(tid)
                    i += k
                    break
            else:
                raise ValueError(f"ToyTokenizer.encode: character {text[i]!r} at {i} is not printable ASCII")
        return [self.bos_id, *out] if add_special_tokens else out

    def encode_split(self, text: str, *, split_words: bool) -> list[int]:
        """A non-canonical segmentation: multi-character pieces spelled out as characters when
        ``split_words`` (a policy's habit; decodes to the same text)."""
        if not split_words:
            return self.encode(text)
        return [self.ids[c] for c in text] if all(c in self.ids for c in text) else self.encode(text)

    def decode(self, ids) -> str:
        return "".join(self.pieces[int(i)] for i in ids)
