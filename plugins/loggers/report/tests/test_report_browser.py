"""The report page in a real headless browser (Debian's chromium): every image decodes, and the
screenshot shows the plots' lines."""
import shutil
import subprocess

import numpy as np

from miles.testing import require_commands
from PIL import Image

CHECK = """<script>addEventListener("load", () => document.body.setAttribute("data-decoded",
  [...document.images].map(i => i.id + ":" + (i.complete && i.naturalWidth > 0 ? i.naturalWidth : 0)).join(" ")));
</script>"""


def chromium():
    if not shutil.which("chromium-browser"):
        require_commands({"chromium": "chromium"})  # Debian's package, installed on first use
    return shutil.which("chromium") or shutil.which("chromium-browser")


def browse(*args, timeout=120):
    # --no-sandbox: the tests run as root, where chromium's sandbox refuses to start
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--virtual-time-budget=10000", *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)


def decoded(page):
    """{img id: natural width} as the browser decoded the page (0: broken image)."""
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text().replace("</body>", CHECK + "</body>"))
    dom = browse("--dump-dom", probe.as_uri()).stdout
    attr = dom.split('data-decoded="', 1)[1].split('"', 1)[0]
    return {k: int(v) for k, v in (item.rsplit(":", 1) for item in attr.split())}


def test_every_image_decodes_in_chromium(async_report):
    _, page = async_report
    widths = decoded(page)
    assert len(widths) == 13 and all(w >= 150 for w in widths.values()), widths
    # the check can fail: a page whose images are corrupt decodes none of them
    broken = page.with_name("broken.html")
    broken.write_text(page.read_text().replace("base64,iVBOR", "base64,AAAA"))
    assert set(decoded(broken).values()) == {0}


def line_pixels(png, rgb, tol=40):
    img = np.asarray(Image.open(png).convert("RGB")).astype(int)
    return int((np.abs(img - np.array(rgb)).max(axis=-1) <= tol).sum())


def test_screenshot_shows_the_plots(async_report):
    run, page = async_report
    shot = run / "shot.png"
    out = browse(f"--screenshot={shot}", "--window-size=1400,4000", page.as_uri())
    assert shot.is_file(), out.stderr[-2000:]
    # matplotlib's first two line colours (the page's own styles are greys): the figures are drawn
    assert line_pixels(shot, (31, 119, 180)) > 2000
    assert line_pixels(shot, (255, 127, 14)) > 500
    assert len(np.unique(np.asarray(Image.open(shot).convert("L")))) > 50  # not a blank page
