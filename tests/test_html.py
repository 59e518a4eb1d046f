"""report.html: one self-contained file that renders in headless Chromium with no network request,
and never lets a name from the model inject markup."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import load_sample
from torch import nn

import converter
from converter.numerics.measure import measure
from converter.report.render import to_html, write_reports

ROOT = Path(__file__).resolve().parents[1]
EVIL = "<script>alert(1)</script>"
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None and os.environ.get("CI") != "true",
    reason="headless Chromium (/usr/bin/chromium) is not installed; in CI (CI=true) these tests must run",
)




class EvilModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.add_module(EVIL, nn.Linear(16, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(getattr(self, EVIL)(x)))


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("html")


@pytest.fixture(scope="module")
def report(out_dir):
    module = load_sample("tiny_transformer")
    conv = converter.convert(module.build_model(), module.example_inputs())
    conv.report.add_measurements(measure(conv))
    write_reports(conv.report, out_dir / "tiny")
    return conv.report


@pytest.fixture(scope="module")
def evil_report(out_dir):
    conv = converter.convert(EvilModel(), (torch.randn(3, 16),))
    conv.report.add_measurements(measure(conv))
    write_reports(conv.report, out_dir / "evil")
    return conv.report


def chromium(url: str, *flags: str, timeout: int = 90) -> subprocess.CompletedProcess:
    if CHROMIUM is None:
        pytest.fail("CI=true but Chromium is not installed (.ci/run installs Debian's chromium)")
    profile = tempfile.mkdtemp(prefix="mp-chromium-")
    try:
        cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", *flags, url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def page_requests(netlog: Path) -> list[str]:
    """URLs of network requests made by the page (the browser's own background requests, e.g. its
    component updater, carry initiator 'not an origin'; anything a page loads carries the page's origin)."""
    data = json.loads(netlog.read_text())
    names = {v: k for k, v in data["constants"]["logEventTypes"].items()}
    found = []
    for event in data["events"]:
        params = event.get("params") or {}
        if names.get(event["type"]) == "URL_REQUEST_START_JOB" and "url" in params:
            if params.get("initiator") != "not an origin":
                found.append(params["url"])
    return found


# ---------------------------------------------------------------------------------------------
# static checks


def test_html_is_one_self_contained_file(report, out_dir):
    text = (out_dir / "tiny" / "report.html").read_text()
    assert text == to_html(report)
    # nothing that could make a request: no URL at all, no src, only in-page links, no external CSS
    assert "http://" not in text and "https://" not in text
    assert not re.search(r"\bsrc\s*=", text, re.I)
    hrefs = re.findall(r"href\s*=\s*[\"']?([^\"'\s>]*)", text, re.I)
    assert hrefs and all(h.startswith("#") for h in hrefs), [h for h in hrefs if not h.startswith("#")]
    assert all(u.startswith("#") for u in re.findall(r"url\(\s*['\"]?([^)'\"]*)", text)), "url() must be in-page"
    for tag in ("<link", "<iframe", "<img", "<object", "<embed", "@import", "@font-face", "<base"):
        assert tag not in text.lower(), tag
    # one inline script, allowed by its hash in a strict Content-Security-Policy
    scripts = re.findall(r"<script>(.*?)</script>", text, re.S)
    assert len(scripts) == 1 and text.count("<script") == 1
    digest = base64.b64encode(hashlib.sha256(scripts[0].encode()).digest()).decode()
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', text).group(1)
    assert "default-src &#x27;none&#x27;" in csp and f"sha256-{digest}" in csp
    # the content: summary line, cards, the precision picture, both plots, the node table
    assert report.line in text.replace("&#x27;", "'")
    for marker in ('id="summary-cards"', 'class="strip-svg"', "Share by precision", "Activation bytes per module",
                   'id="node-table"', 'id="q"', "Saved activations", "Output SQNR vs fp32"):
        assert marker in text, marker
    assert text.count("<svg") >= 3
    ids = re.findall(r'\bid="([^"]+)"', text)
    assert len(ids) == len(set(ids)), "duplicate element ids"
    assert text.count('<tr id="n') == report.summary["compute_nodes"]


def test_html_escapes_model_names(evil_report, out_dir):
    text = (out_dir / "evil" / "report.html").read_text()
    assert any(r["module"] == EVIL for r in evil_report.nodes)
    assert "<script>alert" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    md = (out_dir / "evil" / "report.md").read_text()
    assert "<script>" not in md


def test_html_without_measurements_renders():
    module = load_sample("mlp")
    report = converter.audit(module.build_model(), module.example_inputs())
    text = to_html(report)
    assert "Not measured" in text and report.line in text.replace("&#x27;", "'")


def test_css_and_js_are_shipped_files_inlined_verbatim(report):
    """The page's style and script are converter/report/assets/report.{css,js}, declared as package data and
    inlined whole at render time (so the CSP hash pins exactly the shipped script)."""
    import tomllib

    assets = ROOT / "converter" / "report" / "assets"
    css, js = (assets / "report.css").read_text(encoding="utf-8"), (assets / "report.js").read_text(encoding="utf-8")
    assert "#node-table" in css and "getElementById('node-table')" in js
    text = to_html(report)
    assert re.findall(r"<style>(.*?)</style>", text, re.S)[0] == "\n" + css
    assert re.findall(r"<script>(.*?)</script>", text, re.S) == ["\n" + js]
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["converter.report"]
    shipped = {p.name for g in globs for p in (ROOT / "converter" / "report").glob(g)}
    assert shipped == {"report.css", "report.js"}, (globs, shipped)


# ---------------------------------------------------------------------------------------------
# Chromium


@needs_chromium
def test_renders_in_headless_chromium_without_network(report, out_dir):
    from PIL import Image

    html = out_dir / "tiny" / "report.html"
    shot = out_dir / "report.png"
    netlog = out_dir / "netlog.json"
    proc = chromium(html.as_uri(), "--dump-dom", f"--screenshot={shot}", "--window-size=1400,2000",
                    f"--log-net-log={netlog}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    # the summary is in the DOM, and the script ran under the CSP (it fills in the row count)
    assert report.line in dom.replace("&#x27;", "'"), dom[:500]
    n = report.summary["compute_nodes"]
    assert f'id="count">{n} of {n} nodes<' in dom
    # the screenshot is not blank: bright and dark pixels, and the precision colours are drawn
    image = Image.open(shot).convert("RGB")
    assert image.size == (1400, 2000)
    pixels = torch.tensor(list(image.getdata()), dtype=torch.float32)
    assert pixels.std() > 20, "blank screenshot"
    colours = {tuple(int(c) for c in p) for p in pixels[::7].tolist()}
    assert len(colours) > 50
    def near(rgb):
        target = torch.tensor(rgb, dtype=torch.float32)
        return int(((pixels - target).abs().max(dim=1).values < 12).sum())
    assert near((0x2F, 0x9E, 0x66)) > 500, "no bf16 cells/bars drawn"
    assert near((0xE3, 0x90, 0x3A)) > 500, "no fp32 cells/bars drawn"
    assert page_requests(netlog) == []


@needs_chromium
def test_no_script_injection_in_chromium(evil_report, out_dir):
    html = out_dir / "evil" / "report.html"
    netlog = out_dir / "netlog_evil.json"
    proc = chromium(html.as_uri(), "--dump-dom", f"--log-net-log={netlog}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    assert "<script>alert" not in dom
    assert dom.count("<script") == 1  # only the report's own script element
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom  # the name is shown as text
    assert page_requests(netlog) == []


@needs_chromium
def test_network_check_detects_page_requests(tmp_path):
    """Control: the net-log check does see requests that a page makes."""
    page = tmp_path / "leaky.html"
    page.write_text('<!DOCTYPE html><html><body><img src="http://example.invalid/x.png">'
                    '<link rel="stylesheet" href="https://fonts.example.invalid/f.css">hi</body></html>')
    netlog = tmp_path / "netlog.json"
    proc = chromium(page.as_uri(), "--dump-dom", f"--log-net-log={netlog}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(page_requests(netlog)) == ["http://example.invalid/x.png", "https://fonts.example.invalid/f.css"]
