"""The one rule for text that enters from outside: questions, corpus passages, model output.

JSON may spell a lone UTF-16 surrogate (``"\\ud800"``), and Python decodes it into a ``str``
that cannot be encoded as UTF-8: a tokenizer refuses it, and writing it to a file or a response
raises. So every such code point becomes U+FFFD (the replacement character) where the text is
read, and nothing downstream needs to care.
"""

from __future__ import annotations

import re

__all__ = ["sanitize_text"]

# a surrogate code point on its own in a str; a valid pair was already joined by the decoder
_SURROGATES = re.compile("[\ud800-\udfff]")


def sanitize_text(text: str) -> str:
    """``text`` with every code point that UTF-8 cannot encode replaced by U+FFFD."""
    if text.isascii():  # the common case, checked in C
        return text
    return _SURROGATES.sub("\ufffd", text)
