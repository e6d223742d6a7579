"""The documentation site: it builds with ``mkdocs build --strict``, and its home page and
configuration reference render in a real browser (headless Chromium) with their title,
their navigation and, in the reference, every ``LoGRAConfig`` field.

The site is built into a temporary folder, or taken from ``LOGRA_DOCS_SITE`` (CI builds it
first). Screenshots go to ``LOGRA_DOCS_SCREENSHOTS`` when set. Without MkDocs (the ``docs``
extra) or Chromium the tests skip, unless ``LOGRA_DOCS_REQUIRED=1``, where they fail.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_logra.core.config import LoGRAConfig

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
NAV_TABS = ("Home", "Guides", "Reference", "Design", "Results")


def _unavailable(reason: str) -> None:
    if os.environ.get("LOGRA_DOCS_REQUIRED") == "1":
        pytest.fail(f"{reason} (LOGRA_DOCS_REQUIRED=1)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    prebuilt = os.environ.get("LOGRA_DOCS_SITE")
    if prebuilt:
        folder = Path(prebuilt).resolve()
        assert (folder / "index.html").is_file(), f"LOGRA_DOCS_SITE={prebuilt} holds no built site (no index.html)"
        return folder
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        _unavailable("MkDocs or mkdocs-material is not installed: pip install -e '.[docs]'")
    folder = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(folder)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stdout}\n{built.stderr}"
    return folder


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    executable = next((path for path in map(shutil.which, BROWSERS) if path), None)
    if executable is None:
        _unavailable("Chromium is not installed (Debian: apt-get install chromium)")
    profile = tmp_path_factory.mktemp("chromium-profile")
    shots = os.environ.get("LOGRA_DOCS_SCREENSHOTS")
    shots_folder = Path(shots).resolve() if shots else tmp_path_factory.mktemp("screenshots")
    shots_folder.mkdir(parents=True, exist_ok=True)

    def render(page: Path, screenshot: str) -> str:
        """The page's DOM after its scripts ran, and a screenshot of it."""
        command = [executable, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                   "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1280,1600",
                   "--virtual-time-budget=5000"]
        dom = subprocess.run([*command, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
        assert dom.returncode == 0 and dom.stdout, f"chromium --dump-dom {page} failed:\n{dom.stderr[-2000:]}"
        png = shots_folder / screenshot
        shot = subprocess.run([*command, f"--screenshot={png}", page.as_uri()], capture_output=True, text=True,
                              timeout=120)
        assert shot.returncode == 0, f"chromium --screenshot {page} failed:\n{shot.stderr[-2000:]}"
        data = png.read_bytes()
        # A blank page compresses to a few KiB; a rendered one is far larger.
        assert data.startswith(b"\x89PNG") and len(data) > 20_000, f"{png}: no rendered screenshot ({len(data)} bytes)"
        return dom.stdout

    return render


def assert_rendered(dom: str, title: str) -> None:
    assert f"<title>{title}" in dom, f"title {title!r} missing"
    # Material's scripts ran: they replace the html element's no-js class and wrap tables.
    assert 'class="no-js"' not in dom and "md-typeset__table" in dom, "the theme's JavaScript did not run"
    tabs = re.search(r'<nav class="md-tabs".*?</nav>', dom, re.DOTALL)
    assert tabs, "the navigation tabs are missing"
    labels = [" ".join(re.sub(r"<[^>]+>", " ", link).split())
              for link in re.findall(r'<a [^>]*class="md-tabs__link"[^>]*>(.*?)</a>', tabs.group(0), re.DOTALL)]
    assert all(tab in labels for tab in NAV_TABS), f"navigation tabs {labels}, expected {NAV_TABS}"
    assert '<nav class="md-nav md-nav--primary' in dom, "the side navigation is missing"


def test_the_home_page_renders_with_its_title_and_navigation(browser, site):
    dom = browser(site / "index.html", "home.png")
    assert_rendered(dom, "lightning-logra")
    assert "LoGRAFSDPStrategy" in dom
    assert 'href="quickstart.html"' in dom and 'href="reference/configuration.html"' in dom


def test_the_configuration_reference_renders_every_logra_config_field(browser, site):
    dom = browser(site / "reference" / "configuration.html", "configuration.png")
    assert_rendered(dom, "Configuration")
    assert "<code>kl_budget</code>" in dom
    missing = [f.name for f in dataclasses.fields(LoGRAConfig) if f"<code>{f.name}</code>" not in dom]
    assert not missing, f"LoGRAConfig fields missing from the reference: {missing}"
    for section in ("LossConfig", "RolloutConfig", "GRPOModule", "PromptDataModule", "LoGRAFSDPStrategy"):
        assert f'id="{section.lower()}"' in dom, f"no section for {section}"
