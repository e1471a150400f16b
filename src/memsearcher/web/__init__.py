"""The pages memsearcher shows in a browser, as plain files in the package: the trajectory
viewer ``memsearcher serve`` serves at ``/``, and the scripts and style that it shares with
``eval report --html``.

``turns.js`` draws one turn of a trajectory (thought, query, hits, the memory with what changed,
the context size as a bar) the same way on both pages. Every script sets ``textContent`` only,
so a passage, a memory or an answer is always text, never markup, and nothing is fetched from
anywhere but the page's own server: no CDN, no fonts (the offline rule holds for pages too).
"""

from __future__ import annotations

import base64
import hashlib
from functools import cache
from importlib.resources import files


@cache
def asset(name: str) -> str:
    """The text of one of this package's files (``turns.js``, ``style.css``, ...)."""
    return files(__name__).joinpath(name).read_text(encoding="utf-8")


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@cache
def viewer_page() -> tuple[str, str]:
    """The trajectory viewer (``viewer.html`` with its style and scripts inlined: one request)
    and the Content-Security-Policy to send with it, which lets run exactly that inline script
    and style and lets the page talk to its own server only."""
    style = asset("style.css")
    script = asset("turns.js") + asset("viewer.js")
    page = asset("viewer.html").replace("{style}", style).replace("{script}", script)
    policy = (
        f"default-src 'none'; script-src {_sha256(script)}; style-src {_sha256(style)}; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'"
    )
    return page, policy
