"""The built site renders: headless Chromium loads the home page and the CLI reference from a local HTTP
server, every asset the pages ask for is served, and the screenshots show the theme (its header colour) and the
pages' text. Opt-in (`make docs-check`): it needs Debian's `chromium` and the site built by `make docs`."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "site"
HEADER_RGB = (255, 110, 66)  # the header of Material's "deep orange" palette (mkdocs.yml), as Chromium renders it

pytestmark = pytest.mark.skipif(os.environ.get("SPLITFIRE_TEST_DOCS_SITE") != "1",
                                reason="opt-in: make docs-check (needs chromium and the built site)")


MISSING: list[str] = []  # requests the server answered 404, since the last page


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        if len(args) >= 2 and str(args[1]) == "404":
            MISSING.append(str(args[0]))


@pytest.fixture(scope="module")
def server():
    if not (SITE / "index.html").exists():
        pytest.fail("site/ is not built: run `make docs` first (make docs-check does)")
    handler = functools.partial(_Handler, directory=str(SITE))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("no chromium on PATH: apt-get install chromium")


def _render(url: str, png: Path) -> str:
    base = [_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--window-size=1280,900", "--virtual-time-budget=5000"]
    shot = subprocess.run([*base, f"--screenshot={png}", url], capture_output=True, text=True, timeout=120)
    assert png.exists(), shot.stderr[-2000:]
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    return dom.stdout


def _header_share(png: Path) -> float:
    """Share of the top 48 rows' pixels in the theme's header colour."""
    from PIL import Image

    image = Image.open(png).convert("RGB")
    width = image.width
    pixels = [image.getpixel((x, y)) for y in range(0, 48, 4) for x in range(0, width, 8)]
    near = [p for p in pixels if all(abs(c - h) <= 24 for c, h in zip(p, HEADER_RGB, strict=True))]
    return len(near) / len(pixels)


@pytest.mark.parametrize(("page", "expected"), [("", "splitfire"), ("reference/cli/", "--kv-cache-dtype")])
def test_page_renders_with_the_theme(server, tmp_path, page, expected):
    MISSING.clear()
    png = tmp_path / "page.png"
    dom = _render(f"{server}/{page}", png)
    assert expected in dom
    assert 'class="md-header' in dom, "the Material theme's header is not in the rendered page"
    assert not MISSING, f"assets the page asked for and did not get: {MISSING}"
    share = _header_share(png)
    assert share > 0.5, f"only {share:.0%} of the header band has the theme colour: CSS not applied?"
