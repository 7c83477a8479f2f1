"""The web dashboard (/ui, issue 26 item 5) as an attack surface: a tenant's strings shown to
an admin must not run as script there (the admin key sits in the page's sessionStorage).

Another project's key creates a sandbox whose labels carry HTML and script, and the code
inside it burns CPU so that the usage charts draw its figures; the admin opens the sandbox
table and the sandbox's page in a real headless Chromium. The payloads show as text, no
element is made from them, no script of theirs runs. (A sandbox reaching the apiserver's
port, which serves /ui, is test_cx_network's test_apiserver_and_edge_unreachable.)
"""

from __future__ import annotations

import pytest
from conftest import stranger_key

from dsec.sdk.client import Client
from dsec.testing import browser

pytestmark = pytest.mark.skipif(browser.missing() is not None, reason=f"needs chromium: {browser.missing()}")

PAYLOADS = {
    "img": "<img src=x onerror=\"window.__pwned=1;document.title='pwned'\">",
    "script": "</td><script>window.__pwned=2</script>",
    "svg": "<svg onload=\"window.__pwned=3\"></svg>",
}


async def test_tenant_labels_never_run_in_the_admins_dashboard(server):
    async with Client(server.url, stranger_key(server, "cx-ui")) as tenant:
        sb = await tenant.create_container(image="busybox", cpu_cores=0.1, memory_mb=32, labels=PAYLOADS)
        try:
            await sb.run("(timeout 30 sh -c 'while :; do :; done') >/dev/null 2>&1 &")   # the untrusted part
            d = browser.start()
            try:
                browser.login(d, server.url, server.key)
                for page, where in ((f"#/sandboxes?project={sb.info.project}", "#rows"), (f"#/sandbox/{sb.id}", "#info")):
                    d.get(f"{server.url}/ui/{page}")
                    text = browser.wait_for(lambda: sb.id in d.page_source and PAYLOADS["img"] in
                                            d.execute_script(f"return document.querySelector('{where}').textContent"),
                                            what=f"the payloads as text on {page}")
                    assert text
                    made = d.execute_script(f"return document.querySelectorAll('{where} img, {where} script, "
                                            f"{where} svg').length")
                    assert made == 0, f"{page}: the page made elements out of a tenant's label"
                    assert d.execute_script("return window.__pwned") is None, page
                    assert d.title == "dsec", page
                    assert d.execute_script("return sessionStorage.getItem('dsec.key')") == server.key
            finally:
                browser.stop(d)
        finally:
            await sb.stop()
