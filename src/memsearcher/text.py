"""The one rule for text that enters from outside: questions, corpus passages, model output.

JSON may spell a lone UTF-16 surrogate (``"\\ud800"``), and Python decodes it into a ``str``
that cannot be encoded as UTF-8: a tokenizer refuses it, and writing it to a file or a response
raises. So every such code point becomes U+FFFD (the replacement character) where the text is
read, and nothing downstream needs to care.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["parse_json", "sanitize_text"]

# a surrogate code point on its own in a str; a valid pair was already joined by the decoder
_SURROGATES = re.compile("[\ud800-\udfff]")


def sanitize_text(text: str) -> str:
    """``text`` with every code point that UTF-8 cannot encode replaced by U+FFFD."""
    if text.isascii():  # the common case, checked in C
        return text
    return _SURROGATES.sub("\ufffd", text)


def parse_json(line: str) -> Any:
    """One row of JSON from a file; every way the parser can fail (bad syntax, an integer of
    more than 4,300 digits, nesting deeper than the recursion limit) is a ValueError whose
    message starts "not valid JSON", for the caller to prefix with file and line."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"not valid JSON ({error.msg} at column {error.colno}: {line[:60]!r})"
        ) from None
    except ValueError as error:
        raise ValueError(f"not valid JSON ({error})") from None
    except RecursionError:
        raise ValueError("not valid JSON (nested too deep)") from None
