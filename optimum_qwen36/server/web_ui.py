"""The chat page at `/` (`serve --no-web-ui` leaves it out): static HTML, JS and CSS shipped in the package
(optimum_qwen36/server/web/), hand-written, no framework, no build step. The page talks to this server's
OpenAI endpoints only, as any client would; see docs/WEB_UI.md.

Only `/` and a fixed list of files under `/web/` are routes, so the page can never shadow an API path (the
API has no `/web/` prefix, and an unknown file there is a 404 like any unknown route)."""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from .errors import OpenAIError

# The page loads nothing but its own files and fetches nothing but this server: no inline script or style,
# no other origin, not framable. Images may also be data: URLs (attached images, which are in the page
# already: no request).
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Revalidated on each load: a server upgraded in place serves its new page at once.
    "Cache-Control": "no-cache",
}
# Where index.html takes the server's --default-enable-thinking (the thinking switch's initial state).
DEFAULT_THINKING_PLACEHOLDER = b"DEFAULT_ENABLE_THINKING"
# The files under /web/ and their media types.
ASSETS = {
    "app.js": "text/javascript; charset=utf-8",
    "view.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
    "icon.svg": "image/svg+xml",
}


def _read(name: str) -> bytes:
    return resources.files(__package__).joinpath("web", name).read_bytes()


def install_web_ui(app: FastAPI, *, default_enable_thinking: bool) -> None:
    """Serve the page at GET / and its assets at GET /web/<name>."""
    page = _read("index.html")
    assert page.count(DEFAULT_THINKING_PLACEHOLDER) == 1, "index.html lost its default-enable-thinking meta"
    page = page.replace(DEFAULT_THINKING_PLACEHOLDER, b"true" if default_enable_thinking else b"false")
    assets = {name: _read(name) for name in ASSETS}

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_HEADERS)

    @app.get("/web/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in assets:
            raise OpenAIError(404, f"No web UI file {name!r}.")
        return Response(assets[name], media_type=ASSETS[name], headers=_HEADERS)
