"""The web dashboard (/ui) in a real headless Chromium against a real server (issue 26 item 5).

One module fleet: FLEET sandboxes of the admin's project labelled with this run's tag (more
than the table may hold: the list is paged by the server, the DOM keeps one page), and two of a
team project whose key must see only those. Each page is checked against the API's data and
photographed into docs/ui/. The key never shows in a URL the browser asked for, nor in the
server's log.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest

from dsec import Client
from dsec.testing import browser
from dsec.types import CapacityExceeded, ContainerArgs

pytestmark = pytest.mark.skipif(browser.missing() is not None, reason=f"needs chromium: {browser.missing()}")

SHOTS = Path(__file__).resolve().parents[1] / "docs" / "ui"
FLEET = 110              # > 100: the table must page
SMALL = dict(image="busybox", cpu_cores=0.1, memory_mb=16)


class Fleet:
    def __init__(self, tag: str, root_id: str, team_id: str, team_key: str, team_ids: list[str], ids: list[str]):
        self.tag, self.root_id, self.team_id, self.team_key = tag, root_id, team_id, team_key
        self.team_ids, self.ids = team_ids, ids


@pytest.fixture(scope="module")
async def fleet(server):
    tag = f"ui{os.urandom(3).hex()}"
    async with server.client() as admin:
        root = (await admin.projects())[0].id
        team = await admin.create_project(f"ui-team-{tag}", root, max_sandboxes=2)
        team_key = (await admin.create_key(team.id)).key
        ids: list[str] = []
        args = ContainerArgs(**SMALL, labels={"ui-run": tag}, ttl_idle_s=1800)
        async for c in admin.create_many(FLEET, args, concurrency=8):
            assert c.ok, f"creation {c.index} failed: {c.error}"
            ids.append(c.sandbox.id)
        async with Client(server.url, team_key) as tc:
            team_sbs = [await tc.create_container(**SMALL, labels={"ui-run": tag, "team": "yes"}) for _ in range(2)]
            with pytest.raises(CapacityExceeded):    # over its quota: a refusal the failures page counts
                await tc.create_container(**SMALL)
        # CPU in one sandbox (its 0.1 core) while the module runs, for the usage chart to draw
        await (await admin.get(ids[0])).run("(timeout 900 sh -c 'while :; do :; done') >/dev/null 2>&1 &")
        try:
            yield Fleet(tag, root, team.id, team_key, [s.id for s in team_sbs], ids)
        finally:
            for i in range(0, len(ids) + 2, 16):   # a few at a time: a loaded box's stops queue anyway
                await asyncio.gather(*(_stop(admin, x) for x in (ids + [s.id for s in team_sbs])[i:i + 16]))


async def _stop(admin: Client, sandbox_id: str) -> None:
    try:
        await (await admin.get(sandbox_id)).stop()
    except Exception:          # gone already (TTL): nothing to stop
        pass


@pytest.fixture(scope="module")
def driver():
    d = browser.start()
    yield d
    browser.stop(d)


def _by(sel: str):
    from selenium.webdriver.common.by import By
    return By.CSS_SELECTOR, sel


def rows(d) -> list:
    return d.find_elements(*_by("#rows tr"))


def shot(d, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    d.save_screenshot(str(SHOTS / f"{name}.png"))


def requested_urls(d) -> list[str]:
    """Every URL this tab asked for: the documents and every fetch (resource timing)."""
    return d.execute_script("return performance.getEntries().map(e => e.name)") + [d.current_url]


def test_list_route_pages_and_filters(server, fleet):
    """The server pages and filters: the dashboard never takes the whole fleet."""
    h = {"Authorization": f"Bearer {server.key}"}
    page = httpx.get(f"{server.url}/v1/sandboxes", headers=h, params={"label": f"ui-run={fleet.tag}", "limit": 50},
                     timeout=60).json()
    assert page["total"] == FLEET + 2 and len(page["sandboxes"]) == 50 and page["next_offset"] == 50
    stamps = [s["created_at"] for s in page["sandboxes"]]
    assert stamps == sorted(stamps, reverse=True)          # newest first: pages do not overlap
    last = httpx.get(f"{server.url}/v1/sandboxes", headers=h, timeout=60,
                     params={"label": f"ui-run={fleet.tag}", "limit": 50, "offset": 100}).json()
    assert len(last["sandboxes"]) == FLEET + 2 - 100 and last["next_offset"] is None
    seen = {s["id"] for s in page["sandboxes"]} | {s["id"] for s in last["sandboxes"]}
    assert len(seen) == 50 + FLEET + 2 - 100
    team = httpx.get(f"{server.url}/v1/sandboxes", headers=h, timeout=60,
                     params=[("project", fleet.team_id), ("label", f"ui-run={fleet.tag}"), ("label", "team=yes"),
                             ("state", "running")]).json()
    assert sorted(s["id"] for s in team["sandboxes"]) == sorted(fleet.team_ids) and team["total"] == 2
    # bad filters name the field and the fix, never a 500
    bad = httpx.get(f"{server.url}/v1/sandboxes", headers=h, params={"label": "no-equals"}, timeout=60)
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "label"
    bad = httpx.get(f"{server.url}/v1/sandboxes", headers=h, params={"state": "gone"}, timeout=60)
    assert bad.status_code == 422 and bad.json()["error"]["field"].startswith("state")
    # a project key filtering by a project it cannot see: missing, like other projects' things
    other = httpx.get(f"{server.url}/v1/sandboxes", headers={"Authorization": f"Bearer {fleet.team_key}"},
                      params={"project": fleet.root_id}, timeout=60)
    assert other.status_code == 404 and other.json()["error"]["field"] == "project"


async def test_sdk_listing_pages_and_filters(server, fleet):
    async with Client(server.url, fleet.team_key) as team:
        page = await team.listing(labels={"ui-run": fleet.tag}, limit=1)
        assert page.total == 2 and len(page.sandboxes) == 1 and page.next_offset == 1
        rest = await team.listing(labels={"ui-run": fleet.tag}, states=["running"], limit=1, offset=1)
        assert rest.next_offset is None and {page.sandboxes[0].id, rest.sandboxes[0].id} == set(fleet.team_ids)
        assert (await team.listing(project=fleet.team_id, states=["failed"])).total == 0


def test_dashboard_pages_with_admin_key(server, fleet, driver):
    d = driver
    d.get(f"{server.url}/ui/")
    browser.wait_for(lambda: d.find_element(*_by("#key")), what="the login form")
    shot(d, "login")
    # a wrong key: refused on the page, nothing kept
    d.find_element(*_by("#key")).send_keys("dsk_not-a-key")
    d.find_element(*_by("#login button")).click()
    browser.wait_for(lambda: "unknown or revoked" in d.find_element(*_by("#login-error")).text, what="the refusal")
    assert d.execute_script("return sessionStorage.length") == 0

    browser.login(d, server.url, server.key)
    # nodes: every node of the API, with its pressure and counts by state
    nodes = httpx.get(f"{server.url}/v1/nodes", headers={"Authorization": f"Bearer {server.key}"}, timeout=30).json()
    d.get(f"{server.url}/ui/#/nodes")
    for n in nodes:
        row = browser.wait_for(lambda: d.find_element(*_by(f"tr[data-node='{n['node_id']}']")), what="the node row")
        browser.wait_for(lambda: "running" in row.text and "healthy" in row.text, what="the node's state counts")
    shot(d, "nodes")

    # sandboxes: one server page in the DOM, however many match
    d.get(f"{server.url}/ui/#/sandboxes?label=ui-run%3D{fleet.tag}")
    browser.wait_for(lambda: f"of {FLEET + 2}" in d.find_element(*_by("#count")).text, what="the count of the fleet")
    assert 0 < len(rows(d)) <= 100
    assert len(d.find_elements(*_by("tr"))) <= 101           # + the header: the whole DOM, not just the table
    shown = [r.find_element(*_by("td a")).text for r in rows(d)]
    assert set(shown) <= set(fleet.ids + fleet.team_ids)
    shot(d, "sandboxes")
    d.find_element(*_by("#next")).click()
    browser.wait_for(lambda: d.find_element(*_by("#count")).text.startswith("51-"), what="the second page")
    assert len(rows(d)) <= 100 and not set(shown) & {r.find_element(*_by("td a")).text for r in rows(d)}
    # the filters: project and state through the form
    from selenium.webdriver.support.ui import Select
    Select(d.find_element(*_by("select[name=project]"))).select_by_value(fleet.team_id)
    Select(d.find_element(*_by("select[name=state]"))).select_by_value("running")
    d.find_element(*_by("#filters button")).click()
    browser.wait_for(lambda: d.find_element(*_by("#count")).text == "1-2 of 2", what="the team's two sandboxes")
    assert sorted(r.find_element(*_by("td a")).text for r in rows(d)) == sorted(fleet.team_ids)

    # one sandbox: its record, live usage charts drawn from real samples, its events panel
    sid = fleet.ids[0]
    d.get(f"{server.url}/ui/#/sandbox/{sid}")
    browser.wait_for(lambda: "running" in d.find_element(*_by("#info")).text, what="the sandbox record")
    assert d.find_element(*_by("#sandbox-id")).text == sid
    browser.wait_for(lambda: d.execute_script(
        "const c = document.getElementById('chart-memory'); const px = c.getContext('2d')"
        ".getImageData(0, 0, c.width, c.height).data; let n = 0;"
        "for (let i = 3; i < px.length; i += 4) if (px[i]) n++; return n > 500"), what="the memory chart drawn")
    # live: the chart is redrawn as new samples come (every 5 s while watched), with the CPU burnt
    browser.wait_for(lambda: int(d.find_element(*_by("#chart-cpu")).get_attribute("data-points")) >= 2
                     and float(d.find_element(*_by("#chart-cpu")).get_attribute("data-max")) > 0,
                     timeout_s=60, what="two CPU samples, a busy one")
    ev = browser.wait_for(lambda: d.find_element(*_by("#events")).text.strip() not in ("", "waiting for events..."),
                          what="the events panel")
    assert ev
    if d.find_elements(*_by("#events-unavailable")):       # before the events route exists (issue 26 item 3)
        assert "events not available" in d.find_element(*_by("#events")).text
    else:
        assert "created" in d.find_element(*_by("#events")).text
    shot(d, "sandbox")

    # projects: the team's quota use
    d.get(f"{server.url}/ui/#/projects")
    row = browser.wait_for(lambda: d.find_element(*_by(f"tr[data-project='{fleet.team_id}']")), what="the team row")
    browser.wait_for(lambda: "2 / 2" in row.text, what="the team's quota use")
    shot(d, "projects")

    # failures by reason (one sandbox ended, for the events' count by reason)
    assert httpx.delete(f"{server.url}/v1/sandboxes/{fleet.ids[-1]}", headers={"Authorization": f"Bearer {server.key}"},
                        timeout=60).status_code == 200
    d.get(f"{server.url}/ui/#/failures")
    browser.wait_for(lambda: d.find_element(*_by("#failed")).text and d.find_element(*_by("#refused")).text
                     and d.find_element(*_by("#ended")).text, what="the failures page")
    assert not d.find_elements(*_by("#page-error"))
    browser.wait_for(lambda: "quota" in d.find_element(*_by("#refused")).text, what="the team's quota refusal")
    if not d.find_elements(*_by("#events-unavailable")):    # with the events route: the stop, by its reason
        for _ in range(30):
            if d.find_elements(*_by("#ended tbody tr")):
                break
            d.get(f"{server.url}/ui/#/projects")              # the events page is read once per visit
            d.get(f"{server.url}/ui/#/failures")
            browser.wait_for(lambda: d.find_element(*_by("#ended")).text, what="the ended sandboxes")
        assert d.find_elements(*_by("#ended tbody tr")), d.find_element(*_by("#ended")).text
    shot(d, "failures")

    assert not [u for u in requested_urls(d) if server.key in u]
    errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE" and "/v1/events" not in e["message"]
              and "dsk_not-a-key" not in e["message"] and "401" not in e["message"]]
    assert not errors, errors


def test_project_key_sees_only_its_project(server, fleet, driver):
    d = driver
    d.execute_script("sessionStorage.clear()")
    browser.login(d, server.url, fleet.team_key)
    d.get(f"{server.url}/ui/#/sandboxes")
    browser.wait_for(lambda: d.find_element(*_by("#count")).text == "1-2 of 2", what="the team's own sandboxes")
    assert {r.find_elements(*_by("td"))[1].text for r in rows(d)} == {fleet.team_id}
    assert sorted(r.find_element(*_by("td a")).text for r in rows(d)) == sorted(fleet.team_ids)
    d.get(f"{server.url}/ui/#/projects")
    browser.wait_for(lambda: d.find_element(*_by(f"tr[data-project='{fleet.team_id}']")), what="the team row")
    assert [r.get_attribute("data-project") for r in d.find_elements(*_by("tr[data-project]"))] == [fleet.team_id]
    # another project's sandbox looks missing, page and all
    d.get(f"{server.url}/ui/#/sandbox/{fleet.ids[0]}")
    browser.wait_for(lambda: "404" in d.find_element(*_by("#page-error")).text, what="the refusal")
    assert fleet.ids[0] not in d.find_element(*_by("#info")).text
    assert not [u for u in requested_urls(d) if fleet.team_key in u]


def test_key_never_in_url_or_server_log(server, fleet, driver):
    """The page asked the API for everything with the key in a header only; the server's log
    (everything this server process wrote) holds neither key."""
    d = driver
    urls = requested_urls(d)
    assert any("/v1/sandboxes" in u for u in urls)
    assert not [u for u in urls if server.key in u or fleet.team_key in u]
    assert d.execute_script("return document.referrer") == ""
    log = (server.home / "server.log").read_text(errors="replace")
    assert server.key not in log and fleet.team_key not in log
    # the pages are served with a policy that runs this origin's scripts only
    r = httpx.get(f"{server.url}/ui/", timeout=30)
    assert r.status_code == 200 and "script-src 'self'" in r.headers["content-security-policy"]
    assert httpx.get(f"{server.url}/ui", timeout=30, follow_redirects=False).headers["location"] == "/ui/"
