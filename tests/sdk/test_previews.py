"""Preview URLs (§3.10): the URL the server answers is the one the SDK's
`Sandbox.preview_url(port)` formats from its API URL, with no setting on
either side, and the server serves that host."""

import pandastack
import requests

from conftest import wait_for


def test_the_servers_preview_url_is_the_one_the_sdk_formats(server, fresh_sandbox):
    sandbox_id = fresh_sandbox.id
    auth = {"Authorization": f"Bearer {server.admin_key}"}
    # As behind a TLS proxy at https://api.example.test, which the SDK is pointed at.
    proxied = {**auth, "Host": "api.example.test", "X-Forwarded-Proto": "https"}
    answer = requests.post(f"{server.url}/v1/sandboxes/{sandbox_id}/ports", json={"port": 8000}, headers=proxied, timeout=60)
    assert answer.status_code == 201, answer.text
    behind_proxy = pandastack.Client(api_key=server.admin_key, api_url="https://api.example.test")
    formatted = pandastack.Sandbox.from_dict({"id": sandbox_id}, behind_proxy).preview_url(8000)
    assert answer.json()["preview_url"] == formatted == f"https://8000-{sandbox_id}.example.test"

    # That host is the sandbox's port 8000.
    fresh_sandbox.exec("mkdir -p /srv && echo preview-ok > /srv/index.html && "
                       "(cd /srv && nohup python3 -m http.server 8000 >/dev/null 2>&1 &)")
    host = {"Host": f"8000-{sandbox_id}.example.test"}
    wait_for(lambda: requests.get(f"{server.url}/index.html", headers=host, timeout=30).text == "preview-ok\n",
             timeout=60, what="the preview host to serve the sandbox's port")

    # Reached directly (an IP address has no subdomains): localhost and the port.
    listed = requests.get(f"{server.url}/v1/sandboxes/{sandbox_id}/ports", headers=auth, timeout=60).json()
    urls = {p["port"]: p["preview_url"] for p in (listed["ports"] if isinstance(listed, dict) else listed)}
    assert urls[8000] == f"http://8000-{sandbox_id}.localhost:{server.port}"
    local = server.client()
    local.preview_host = f"localhost:{server.port}"
    assert local.sandboxes.get(sandbox_id).preview_url(8000, scheme="http") == urls[8000]
