"""The Prefect UI shows an E31 run: headless Chromium on the flow run page of a real server.

A real job runs through ``e31 run`` against the session's Prefect server; then
Debian's chromium, driven by Playwright, opens the pages a user would open and
reads what they show: the meter tags, the meter and outputs artifacts (the
table's rows and the link), and the ``e31.job.*`` events in the event feed.

Needs a Chromium (``scripts/browser.sh`` installs Debian's; ``E31_CHROMIUM``
names another) and PyPI's ``playwright``. Without them the test is skipped,
with the reason, unless ``E31_REQUIRE_BROWSER=1`` (as in CI), where it fails.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from e31_prefect.model.meter import tag_seconds
from tests.integration.conftest import cli, flow_run_id
from tests.integration.test_jobs_end_to_end import read_run, write_job

pytestmark = pytest.mark.integration

# RECIPES.md: without the background-networking flags this closed network refuses many of chromium's
# connections. Playwright gives every launch a fresh temporary --user-data-dir of its own.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# The UI renders on a 2-core machine that other tests share: wait long for what must appear.
WAIT_MS = 60_000
E31_STEPS = ["e31.job.staged", "e31.job.rented", "e31.job.running", "e31.job.output", "e31.job.released"]


def _no_browser(reason: str) -> None:
    if os.environ.get("E31_REQUIRE_BROWSER") == "1":
        pytest.fail(reason + "; E31_REQUIRE_BROWSER=1 makes the UI test required")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def chromium_path() -> str:
    """The Chromium to drive (``E31_CHROMIUM``, else Debian's), checked before any server starts."""
    executable = os.environ.get("E31_CHROMIUM", "/usr/bin/chromium")
    if not os.access(executable, os.X_OK):
        _no_browser(f"no Chromium at {executable}; install Debian's with scripts/browser.sh "
                    "(or point E31_CHROMIUM at one)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _no_browser("Playwright is not installed; pip install -e '.[test]' -c constraints.txt")
    return executable


@pytest.fixture(scope="module")
def chromium(chromium_path: str) -> Iterator[Any]:
    """That Chromium launched headless through Playwright; never a browser Playwright downloads."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


@contextmanager
def screenshot_on_failure(page: Any, folder: Path) -> Iterator[None]:
    """Keep a full-page screenshot of what the browser showed when an assertion failed."""
    try:
        yield
    except BaseException as error:
        shot = folder / "ui-failure.png"
        try:
            page.screenshot(path=str(shot), full_page=True)
        except Exception as shot_error:  # the page may be gone; the original failure matters more
            shot = f"(no screenshot: {shot_error})"
        error.add_note(f"the page at {page.url} is in {shot}")
        raise


def meter_line(output: str, step: str) -> str:
    """The seconds figure of one line of the meter that ``e31 run`` prints (``  total billed   6.133 s ...``)."""
    for line in output.splitlines():
        if line.strip().startswith(step):
            return re.search(r"(\d+\.\d{3}) s", line).group(1)
    raise AssertionError(f"no {step!r} line in the meter printed by e31 run:\n{output}")


def test_flow_run_page_shows_meter_tags_artifacts_and_events(chromium_path, prefect_server, tmp_path, pool,
                                                               chromium):
    from playwright.sync_api import expect

    job = write_job(tmp_path / "ui-job", """
        name: ui-meter
        team: vision
        work: {flow: flow.py:report}
        request: {gpus: 1, max_duration: 5m}
        output: {to: ./out/, expect: [report.txt]}
        """, flow="""
        from prefect import flow
        from e31_prefect import output_dir

        @flow
        def report():
            (output_dir() / "report.txt").write_text("seen in the UI")
        """)
    result = cli("e31", "run", str(job), "--now", "--pool", pool, gpus="1xH100")
    assert result.returncode == 0, result.stdout + result.stderr
    run_id = flow_run_id(result.stdout)
    outputs_url = (tmp_path / "ui-job" / "out").as_uri() + "/"
    assert f"Outputs: {outputs_url}" in result.stdout
    billed = meter_line(result.stdout, "total billed")
    tags = [t for t in read_run(run_id).tags if t.startswith("e31")]
    assert {"e31", "e31:gpus=1", "e31:team=vision"} <= set(tags)
    assert f"e31:billed-s={tag_seconds(float(billed))}" in tags and any(t.startswith("e31:run-s=") for t in tags)

    ui = prefect_server.removesuffix("/api")
    page = chromium.new_page(viewport={"width": 1600, "height": 1200})
    page.set_default_timeout(WAIT_MS)
    expect.set_options(timeout=WAIT_MS)
    with screenshot_on_failure(page, tmp_path):
        # The flow run page: its header carries the meter as tags (gpus, billed and run seconds, team).
        page.goto(f"{ui}/runs/flow-run/{run_id}")
        for tag in tags:
            expect(page.get_by_text(tag, exact=True).first).to_be_visible()

        # The Artifacts tab: a card per artifact, the bill and the destination in their descriptions.
        page.get_by_text("Artifacts", exact=True).first.click()
        meter_card = page.locator("a", has_text="e31-meter-ui-meter").first
        outputs_card = page.locator("a", has_text="e31-outputs-ui-meter").first
        expect(meter_card).to_contain_text(f"{billed} GPU-seconds billed")
        expect(outputs_card).to_contain_text(outputs_url)

        # The meter artifact: the table with a row per step and the billed total printed by e31 run.
        meter_card.click()
        table = page.locator("table")
        for header in ("step", "at", "seconds", "billed", "meaning"):
            expect(table.locator("th", has_text=re.compile(rf"^\s*{header}\s*$"))).to_have_count(1)
        for step in ("rented", "run_ended", "output"):
            expect(table.locator("tr", has_text=step).first).to_be_visible()
        expect(table.locator("tr", has_text="total billed")).to_contain_text(billed)

        # The outputs artifact: a link to where the outputs went.
        page.go_back()
        page.get_by_text("Artifacts", exact=True).first.click()
        page.locator("a", has_text="e31-outputs-ui-meter").first.click()
        expect(page.locator(f'a[href="{outputs_url}"]')).to_have_text(outputs_url)

        # The event feed filtered to the run and to e31's events: every step of the job's life.
        # Events reach the feed a moment after they are emitted, so reload until all are there.
        seen: set[str] = set()
        for _ in range(10):
            page.goto(f"{ui}/events?resource=prefect.flow-run.{run_id}&events=e31.job.*", wait_until="networkidle")
            expect(page.get_by_text("Event Feed").first).to_be_visible()
            text = page.locator("body").inner_text()
            seen = {step for step in E31_STEPS if step in text}
            if seen == set(E31_STEPS):
                break
            page.wait_for_timeout(2000)
        assert seen == set(E31_STEPS), f"the event feed shows {sorted(seen)} of {E31_STEPS}"
        for step in E31_STEPS:
            expect(page.get_by_text(step, exact=True).first).to_be_visible()
    page.close()
