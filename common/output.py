"""Per-request output text: incremental detokenization plus stop-string handling.

Stop strings match on text, which only the frontend has, so the frontend finishes a
request when one appears. While streaming, text that could still turn into a stop
string is held back, so a client never sees part of a stop string.
"""

from __future__ import annotations

from common.tokenizer import Tokenizer


class OutputTracker:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._detok = tokenizer.detokenizer()
        self._stop = tuple(s for s in stop if s)
        self._text = ""  # all text so far (truncated at a stop string once one matched)
        self._sent = 0  # characters already handed out by `feed`
        self.stopped = False
        # Tokens the text is made of: those fed, up to the one that completed a stop
        # string (a speculative step lands several tokens at once: the ones after it are
        # not part of the output); `last_used`: of the last feed's tokens.
        self.num_tokens = 0
        self.last_used = 0

    @property
    def text(self) -> str:
        return self._text

    def feed(self, token_ids: list[int], final: bool = False) -> str:
        """Add new tokens; return the text that is now safe to send."""
        if self.stopped:
            self.last_used = 0
            return ""
        if len(token_ids) > 1 and self._stop:
            parts, used = [], 0
            for tok in token_ids:  # a stop string may end inside the run
                parts.append(self._feed([tok], False))
                used += 1
                if self.stopped:
                    break
            if final and not self.stopped:
                parts.append(self._feed([], True))
        else:
            parts, used = [self._feed(token_ids, final)], len(token_ids)
        self.last_used = used
        self.num_tokens += used
        return "".join(parts)

    def _feed(self, token_ids: list[int], final: bool) -> str:
        self._text += self._detok.feed(token_ids)
        if final:
            self._text += self._detok.flush()
        hold = 0
        for s in self._stop:
            i = self._text.find(s, max(0, self._sent - len(s) + 1))
            if i >= 0:
                self._text = self._text[:i]
                self.stopped = True
                hold = 0
                break
            # Longest suffix of the text that is a prefix of this stop string.
            for k in range(min(len(s) - 1, len(self._text)), 0, -1):
                if self._text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        if final or self.stopped:
            hold = 0
        end = max(self._sent, len(self._text) - hold)
        delta = self._text[self._sent : end]
        self._sent = end
        return delta

    def finish(self) -> str:
        """The request ended: release whatever was held back."""
        return self.feed([], final=True)
