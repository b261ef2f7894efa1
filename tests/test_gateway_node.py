"""The agent gateway on a node of its own (network namespaces, tests/netns_cluster.py).

Node B runs the built-in server (tiny model) and one proxy worker in front of it; node C
runs the gateway (``python -m areal.experimental.openai.proxy.gateway``) in front of B's
proxy worker, bound to C's address; node A, the trainer's node, plays an agent episode
through the gateway with the OpenAI SDK (start a session with the run's admin key, two
chat completions with the session key, reward, end, export). Then, from node B, calls
without the admin key (none, or a wrong one) are refused with 401 and change nothing;
every listening socket of node C is on C's address, none on 0.0.0.0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from test_cluster_security import _from_node, _listening, _wait_http

from areal.models.tiny import get_tiny_base_path
from areal.utils.auth import PROXY_ADMIN_KEY_ENV, RUN_SECRET_ENV

SERVER_PORT, PROXY_PORT, GATEWAY_PORT = 18210, 18310, 18410
ADMIN = "gateway-node-admin"

pytestmark = pytest.mark.slow

# Runs on node A: one agent episode through the gateway at argv[1]; prints the export.
EPISODE = """
import json, sys, urllib.request
import openai
gw, admin = sys.argv[1], sys.argv[2]

def post(path, body, key):
    req = urllib.request.Request(gw + path, data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read() or b"{}")

s = post("/rl/start_session", {"task_id": "node-a"}, admin)
client = openai.OpenAI(base_url=gw + "/v1", api_key=s["api_key"], max_retries=0)
msgs = [{"role": "user", "content": "What is 2 + 3?"}]
for _ in range(2):
    out = client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
    msgs += [{"role": "assistant", "content": out.choices[0].message.content or ""},
             {"role": "user", "content": "And 1 + 1?"}]
post("/rl/set_reward", {"reward": 1.0}, s["api_key"])
post("/rl/end_session", {}, s["api_key"])
exp = post("/export_trajectories",
           {"session_id": s["session_id"], "discount": 1.0, "style": "individual"}, admin)
print(json.dumps({"session_id": s["session_id"], "n": len(exp["interactions"])}))
"""


def test_gateway_on_own_node_serves_episode_binds_node_address_refuses_without_key(
    netns_cluster, tmp_path
):
    c = netns_cluster
    b, cc = c["b"].addr, c["c"].addr
    model = get_tiny_base_path()
    env = dict(os.environ, OMP_NUM_THREADS="1", **{PROXY_ADMIN_KEY_ENV: ADMIN})
    logs = {n: open(tmp_path / f"{n}.log", "w") for n in ("server", "proxy", "gateway")}
    procs = []
    try:
        procs.append(
            c.popen(
                "b",
                [sys.executable, "-m", "areal.inference.server", "--model-path", model,
                 "--host", b, "--port", str(SERVER_PORT)],
                env=env, stdout=logs["server"], stderr=subprocess.STDOUT,
            )
        )  # fmt: skip
        procs.append(
            c.popen(
                "b",
                [sys.executable, "-m", "areal.experimental.openai.proxy",
                 "--server-addrs", f"{b}:{SERVER_PORT}", "--tokenizer", model,
                 "--host", b, "--port", str(PROXY_PORT), "--chat-template-type", "concat",
                 "--engine-max-tokens", "256"],
                env=env, stdout=logs["proxy"], stderr=subprocess.STDOUT,
            )
        )  # fmt: skip
        procs.append(
            c.popen(
                "c",
                [sys.executable, "-m", "areal.experimental.openai.proxy.gateway",
                 "--workers", f"http://{b}:{PROXY_PORT}", "--host", cc,
                 "--port", str(GATEWAY_PORT), "--health-interval", "0.5"],
                env=env, stdout=logs["gateway"], stderr=subprocess.STDOUT,
            )
        )  # fmt: skip
        gw = f"http://{cc}:{GATEWAY_PORT}"
        _wait_http(f"http://{b}:{PROXY_PORT}/health", procs[1])
        _wait_http(f"{gw}/health", procs[2])
        deadline = time.monotonic() + 60  # the gateway sees its worker live
        while (
            json.loads(_from_node(c, "a", [(f"{gw}/health", None, {})], env)[0][1]).get(
                "live_workers"
            )
            != 1
        ):
            assert time.monotonic() < deadline, open(tmp_path / "gateway.log").read()[-3000:]
            time.sleep(0.5)

        # node A (the trainer's node): an agent episode through the gateway on node C
        r = c.run("a", [sys.executable, "-c", EPISODE, gw, ADMIN], env=env, timeout=180)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        episode = json.loads(r.stdout.strip().splitlines()[-1])
        assert episode["n"] == 2, episode

        # node B, no admin key in its environment: refused, before anything is forwarded
        env_b = {
            k: v for k, v in os.environ.items() if k not in (RUN_SECRET_ENV, PROXY_ADMIN_KEY_ENV)
        }
        wrong = {"Authorization": "Bearer not-the-key", "Content-Type": "application/json"}
        start = json.dumps({"task_id": "x"}).encode()
        denied = [
            (f"{gw}/rl/start_session", start, {}),
            (f"{gw}/rl/start_session", start, wrong),
            (f"{gw}/export_trajectories", json.dumps(episode).encode(), wrong),
            (f"{gw}/v1/chat/completions", b"{}", {}),
            (f"{gw}/gateway/stats", None, {}),
        ]
        answers = _from_node(c, "b", denied, env_b)
        assert [s for s, _ in answers] == [401] * len(denied), list(zip(denied, answers))
        # nothing was opened or forwarded by them: the gateway counts node A's session only
        req = urllib.request.Request(
            f"{gw}/gateway/stats", headers={"Authorization": f"Bearer {ADMIN}"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            stats = json.loads(resp.read())
        assert stats["sessions_started"] == 1 and stats["open_sessions"] == 0, stats
        assert [w["sessions_total"] for w in stats["workers"]] == [1], stats
        gw_log = open(tmp_path / "gateway.log").read()
        assert f"401 POST /rl/start_session from {b}" in gw_log, gw_log[-3000:]

        # the gateway listens on node C's address only (never 0.0.0.0)
        listening = _listening(c, "c")
        assert (cc, GATEWAY_PORT) in listening, listening
        assert {addr for addr, _ in listening} <= {cc, "127.0.0.1"}, listening
        assert f"proxy gateway listening on {gw}" in open(tmp_path / "gateway.log").read()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs.values():
            f.close()
