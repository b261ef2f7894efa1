"""The proxy gateway under load: 2 proxy workers, 2 built-in servers, many external clients.

Real components on 127.0.0.1: 2 built-in inference servers (tiny random Qwen2 with the
tiny tokenizer), 2 proxy workers (``python -m areal.experimental.openai.proxy``, scheduler
role ``proxy`` of a LocalScheduler, each in front of both servers) and the gateway as its
own process (``python -m areal.experimental.openai.proxy.gateway``). A *session* is what
an external client does: start (admin key), ``--calls`` chat completions of
``--max-tokens`` tokens (every other one streamed), set a reward, end, export.

Phases (JSON on stdout):

1. ``load``: ``--sessions`` sessions from ``--clients`` concurrent clients through the
   gateway: sessions/s, ``lost`` (sessions that neither completed nor were reported
   failed: must be 0), ``not_on_one_worker`` (sessions whose export from their worker
   does not hold every call: a call routed elsewhere is refused there, so this is the
   affinity check: must be 0) and the sessions each worker took;
2. ``latency``: per-call latency through the gateway and directly to a proxy worker
   (``--latency-sessions`` sessions each way, interleaved, ``--latency-clients``
   concurrent): median and p95 of both and of the difference (added by the gateway),
   for chat calls and for ``/rl/set_reward`` (no model work: the gateway's own cost);
3. ``kill``: ``--kill-sessions`` sessions from ``--clients`` clients, one proxy worker
   killed (SIGKILL) when half of them have completed: ``completed``, ``failed_reported``
   (sessions whose clients got the gateway's ``proxy_worker_failed`` error),
   ``failed_counted`` (the gateway's own count), ``lost`` (must be 0), and
   ``sessions_started_on_killed_worker_after_kill`` (new sessions go to the survivor: 0).

    .venv/bin/python benchmarks/bench_gateway.py [--sessions 512 --clients 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

ADMIN = "bench-gateway-admin-key"
QUESTION = [{"role": "user", "content": "What is 12 + 30?"}]


class WorkerFailed(Exception):
    """The gateway reported the session failed (proxy_worker_failed)."""


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _post(http, url: str, key: str, body: dict | None = None):
    """(status, parsed JSON or text, seconds); raises WorkerFailed on the gateway's report."""
    t0 = time.perf_counter()
    async with http.post(url, json=body or {}, headers=_h(key)) as r:
        text = await r.text()
        dt = time.perf_counter() - t0
        if r.content_type == "text/event-stream":
            if "proxy_worker_failed" in text:
                raise WorkerFailed(text)
            return r.status, text, dt
        data = json.loads(text) if text else {}
    if r.status == 502 and data.get("error", {}).get("type") == "proxy_worker_failed":
        raise WorkerFailed(data["error"]["message"])
    if r.status != 200:
        raise RuntimeError(f"{url} answered {r.status}: {text[:300]}")
    return r.status, data, dt


async def _session(http, base: str, admin_base: str, args, lat: dict | None = None) -> dict:
    """One external session; returns its record."""
    _, s, _ = await _post(http, f"{admin_base}/rl/start_session", ADMIN, {"task_id": "b"})
    key = s["api_key"]
    for i in range(args.calls):
        body = {
            "model": "m",
            "messages": QUESTION,
            "max_tokens": args.max_tokens,
            "stream": i % 2 == 1,
        }
        _, _, dt = await _post(http, f"{base}/v1/chat/completions", key, body)
        if lat is not None:
            lat["chat"].append(dt)
    _, _, dt = await _post(http, f"{base}/rl/set_reward", key, {"reward": 1.0})
    if lat is not None:
        lat["reward"].append(dt)
    await _post(http, f"{base}/rl/end_session", key)
    _, exp, _ = await _post(
        http,
        f"{admin_base}/export_trajectories",
        ADMIN,
        {"session_id": s["session_id"], "discount": 1.0, "style": "individual"},
    )
    return {"session_id": s["session_id"], "calls": len(exp["interactions"])}


async def _run_sessions(base: str, n: int, clients: int, args, on_done=None) -> dict:
    import aiohttp

    queue: asyncio.Queue = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    out = {"completed": [], "failed": [], "errors": []}
    timeout = aiohttp.ClientTimeout(total=args.call_timeout)

    async def client() -> None:
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                try:
                    queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                try:
                    out["completed"].append(await _session(http, base, base, args))
                except WorkerFailed as e:
                    out["failed"].append(str(e)[:200])
                except Exception as e:  # noqa: BLE001 - counted as lost
                    out["errors"].append(f"{type(e).__name__}: {e}"[:300])
                if on_done is not None:
                    on_done(len(out["completed"]))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    out["seconds"] = time.perf_counter() - t0
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _ms(x: float) -> float:
    return round(1000 * x, 2)


async def _latency(gateway: str, worker: str, args) -> dict:
    import aiohttp

    lat = {"gateway": {"chat": [], "reward": []}, "direct": {"chat": [], "reward": []}}
    sem = asyncio.Semaphore(args.latency_clients)

    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=args.call_timeout)
    ) as http:

        async def one(i: int) -> None:
            async with sem:
                which = "gateway" if i % 2 == 0 else "direct"
                base = gateway if which == "gateway" else worker
                await _session(http, base, base, args, lat[which])

        await asyncio.gather(*(one(i) for i in range(2 * args.latency_sessions)))
    result = {}
    for kind in ("chat", "reward"):
        g, d = lat["gateway"][kind], lat["direct"][kind]
        result[kind] = {
            "calls_each": len(g),
            "gateway_median_ms": _ms(statistics.median(g)),
            "gateway_p95_ms": _ms(_pct(g, 0.95)),
            "direct_median_ms": _ms(statistics.median(d)),
            "direct_p95_ms": _ms(_pct(d, 0.95)),
            "added_median_ms": _ms(statistics.median(g) - statistics.median(d)),
            "added_p95_ms": _ms(_pct(g, 0.95) - _pct(d, 0.95)),
        }
    return result


def _stats(base: str) -> dict:
    import requests

    return requests.get(f"{base}/gateway/stats", headers=_h(ADMIN), timeout=30).json()


def _start_gateway(urls: list[str], tmp: str) -> tuple[subprocess.Popen, str]:
    addr_file = os.path.join(tmp, "gateway_addr")
    env = dict(os.environ, AREAL_PROXY_ADMIN_KEY=ADMIN, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal.experimental.openai.proxy.gateway",
            "--workers",
            ",".join(urls),
            "--addr-file",
            addr_file,
            "--health-interval",
            "1.0",
        ],
        env=env,
    )
    deadline = time.monotonic() + 60
    while not os.path.exists(addr_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the gateway process did not come up")
        time.sleep(0.1)
    with open(addr_file) as f:
        return proc, f.read().strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=512)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--calls", type=int, default=2, help="chat calls per session")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--latency-sessions", type=int, default=48)
    p.add_argument("--latency-clients", type=int, default=4)
    p.add_argument("--kill-sessions", type=int, default=256)
    p.add_argument("--call-timeout", type=float, default=120.0)
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    from conftest import build_tiny_lm_with_tokenizer

    from areal.api.cli_args import AgentConfig, InferenceEngineConfig
    from areal.experimental.openai.proxy.gateway import (
        PROXY_ROLE,
        proxy_worker_command,
        start_proxy_workers,
    )
    from areal.inference.clients.local import RemoteLocalEngine
    from areal.infra.scheduler.local import LocalScheduler

    tmp = tempfile.mkdtemp(prefix="bench_gateway_")
    model = build_tiny_lm_with_tokenizer(os.path.join(tmp, "model"))
    launcher = RemoteLocalEngine(InferenceEngineConfig(setup_timeout=180))
    servers = launcher.launch_server({"model_path": model, "num_servers": 2})
    sched = LocalScheduler(tmp, "bench", "gateway", kill_grace=1.0)
    gw_proc = None
    try:
        cfg = AgentConfig(chat_template_type="concat", engine_max_tokens=256)
        command = proxy_worker_command(list(servers), model, cfg, args.call_timeout)
        urls = start_proxy_workers(sched, 2, command, ADMIN, timeout=180)
        gw_proc, gateway = _start_gateway(urls, tmp)
        report: dict = {
            "setup": {
                "servers": len(servers),
                "proxy_workers": len(urls),
                "calls_per_session": args.calls,
                "max_tokens": args.max_tokens,
                "clients": args.clients,
            }
        }

        # 1. load
        run = asyncio.run(_run_sessions(gateway, args.sessions, args.clients, args))
        stats = _stats(gateway)
        report["load"] = {
            "sessions": args.sessions,
            "completed": len(run["completed"]),
            "failed_reported": len(run["failed"]),
            "lost": args.sessions - len(run["completed"]) - len(run["failed"]),
            "not_on_one_worker": sum(r["calls"] != args.calls for r in run["completed"]),
            "seconds": round(run["seconds"], 2),
            "sessions_per_s": round(len(run["completed"]) / run["seconds"], 2),
            "calls_per_s": round(len(run["completed"]) * args.calls / run["seconds"], 2),
            "sessions_per_worker": [w["sessions_total"] for w in stats["workers"]],
            "gateway_sessions_failed": stats["sessions_failed"],
            "errors": run["errors"][:5],
        }

        # 2. latency, gateway vs direct to worker 0
        report["latency"] = asyncio.run(_latency(gateway, urls[0], args))

        # 3. one worker killed midway
        before = _stats(gateway)
        victim_pid = sched.worker_pids(PROXY_ROLE)[0]
        killed = {"at": None, "victim_total": None}

        def on_done(completed: int) -> None:
            if killed["at"] is None and completed >= args.kill_sessions // 2:
                killed["victim_total"] = _stats(gateway)["workers"][0]["sessions_total"]
                os.kill(victim_pid, signal.SIGKILL)
                killed["at"] = completed

        run = asyncio.run(_run_sessions(gateway, args.kill_sessions, args.clients, args, on_done))
        after = _stats(gateway)
        per_worker_after_kill = [
            a["sessions_total"] - b["sessions_total"]
            for a, b in zip(after["workers"], before["workers"], strict=True)
        ]
        report["kill"] = {
            "sessions": args.kill_sessions,
            "killed_after_completed": killed["at"],
            "completed": len(run["completed"]),
            "failed_reported": len(run["failed"]),
            "failed_counted_by_gateway": after["sessions_failed"] - before["sessions_failed"],
            "lost": args.kill_sessions - len(run["completed"]) - len(run["failed"]),
            "not_on_one_worker": sum(r["calls"] != args.calls for r in run["completed"]),
            "seconds": round(run["seconds"], 2),
            "sessions_per_worker_in_this_run": per_worker_after_kill,
            "sessions_started_on_killed_worker_after_kill": (
                after["workers"][0]["sessions_total"] - killed["victim_total"]
            ),
            "workers_alive": [w["alive"] for w in after["workers"]],
            "example_failure": run["failed"][0] if run["failed"] else None,
            "errors": run["errors"][:5],
        }
        print(json.dumps(report, indent=2))
    finally:
        if gw_proc is not None:
            gw_proc.terminate()
            gw_proc.wait(10)
        sched.close()
        launcher.teardown_server()


if __name__ == "__main__":
    main()
