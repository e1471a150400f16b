"""The one rule for text that enters from outside: questions, corpus passages, model output.

JSON may spell a lone UTF-16 surrogate (``"\\ud800"``), and Python decodes it into a ``str``
that cannot be encoded as UTF-8: a tokenizer refuses it, and writing it to a file or a response
raises. So every such code point becomes U+FFFD (the replacement character) where the text is
read, and nothing downstream needs to care.

Here too: `parse_json`, which turns every way a row can fail to parse into one ValueError, and
`normalize_answer`, the SQuAD/FlashRAG answer normalization that the metrics score with and the
question readers check gold answers against.
"""

from __future__ import annotations

import json
import re
import string
from typing import Any

__all__ = ["normalize_answer", "parse_json", "sanitize_text"]

# a surrogate code point on its own in a str; a valid pair was already joined by the decoder
_SURROGATES = re.compile("[\ud800-\udfff]")
_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


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


def normalize_answer(text: str) -> str:
    """Lower-case, drop ASCII punctuation, drop the articles a/an/the, collapse whitespace.

    The steps run in SQuAD/FlashRAG order, and the order matters: punctuation goes before
    articles, so "the-end" becomes "theend" and keeps its "the". Only ``string.punctuation``
    is removed; accents and non-ASCII punctuation ("é", "—", "’") stay. Articles are removed
    as whole words only ("theory" keeps its "the"). Whitespace is anything ``str.split``
    splits on, Unicode spaces included.
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())
