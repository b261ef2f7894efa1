"""OpenEnv servers as multi-turn rollout workflows (``areal.workflow.openenv``).

An `OpenEnv <https://github.com/meta-pytorch/OpenEnv>`_ environment is an HTTP server
(``openenv-core``, the ``envs`` extra) with ``reset`` / ``step``; a session talks to it
over the server's WebSocket endpoint with openenv's own ``GenericEnvClient`` (the
adapter TRL uses). :class:`OpenEnvAgent` is an *agent* the trainer runs through the
OpenAI-compatible proxy (every model call captured with its tokens and log-probabilities,
one training row per call):

1. ``reset(**data["reset"])`` (the row's ``reset`` dict, e.g. ``{"seed": 3}``): the first
   observation becomes the first user turn (after ``system_prompt``);
2. the model answers; its text is the action (``{action_field: text}``), sent with
   ``step``; the step's observation becomes the next user turn;
3. until the environment says ``done`` or ``max_turns`` model calls.

Rewards: ``reward_mode="per_step"`` (default) gives each call the reward of the step it
made (``None``: 0.0); ``"final"`` gives the sum of the episode's step rewards to its last
call (the proxy's turn discount spreads it back). An observation is rendered as its
``observation_field`` (default ``prompt``) when it has one, else as the JSON of its fields
but ``done``/``reward``/``metadata``.

The server: ``base_url`` of a running one, or ``app="module:attr"`` (a FastAPI app, e.g.
from openenv's ``create_fastapi_app``) that the agent starts once per process with
uvicorn on 127.0.0.1 (a free port, the trainer's import path) and stops at exit.

Failures fail the episode, which the proxy workflow counts (``rollout/agent_failed``),
logs with the cause and rejects; the run goes on: the server unreachable or dead, an
error from ``reset``/``step``, no reward at all in ``final`` mode, an episode past
``timeout`` seconds.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

from areal.utils import logging

logger = logging.getLogger("OpenEnvAgent")

_SERVERS: dict[str, tuple[subprocess.Popen, str]] = {}
_SERVERS_LOCK = threading.Lock()
REWARD_MODES = ("per_step", "final")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_servers() -> None:
    with _SERVERS_LOCK:
        for proc, _ in _SERVERS.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        _SERVERS.clear()


def start_server(app: str, startup_timeout: float = 300.0) -> str:
    """Start (once per process) a uvicorn server for ``app`` (``"module:attr"``) on
    127.0.0.1; returns its base URL. Stopped at exit (:func:`stop_servers`)."""
    with _SERVERS_LOCK:
        entry = _SERVERS.get(app)
        if entry is not None and entry[0].poll() is None:
            return entry[1]
        port = _free_port()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [p for p in sys.path if p] + [env.get("PYTHONPATH", "")]
        )
        cmd = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                out = proc.stdout.read().decode(errors="replace")[-3000:] if proc.stdout else ""
                raise RuntimeError(f"OpenEnv server {app!r} exited with {proc.returncode}:\n{out}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"OpenEnv server {app!r} not healthy after {startup_timeout}s")
            time.sleep(0.2)
        if not _SERVERS:
            atexit.register(_stop_servers)
        _SERVERS[app] = (proc, url)
        # uvicorn's log goes to a pipe nobody reads: drain it so the server never blocks
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        logger.info("OpenEnv server %s at %s (pid %d)", app, url, proc.pid)
        return url


def stop_servers() -> None:
    """Stop the servers :func:`start_server` started."""
    _stop_servers()


def openenv_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` dataset rows ``{"reset": {"seed": seed + i}}``: one episode per seed."""
    return [{"reset": {"seed": seed + i}} for i in range(n)]


class OpenEnvAgent:
    """An OpenEnv server as a multi-turn agent (module docstring).

    Args:
        base_url: a running server (``http://host:port``), or
        app: ``"module:attr"`` of a FastAPI app this process starts (once).
        action_field: the action's field that carries the model's text.
        observation_field: the observation's field rendered as the next user turn.
        system_prompt: an optional system turn before the first observation.
        max_turns: model calls per episode at most.
        reward_mode: ``per_step`` or ``final`` (module docstring).
        timeout: seconds one episode may take.
        model: the model name sent to the proxy.
        kwargs: sampling arguments of every call (``temperature``, ``top_p``,
            ``max_completion_tokens``/``max_tokens``).
    """

    def __init__(
        self,
        base_url: str | None = None,
        app: str | None = None,
        action_field: str = "message",
        observation_field: str = "prompt",
        system_prompt: str | None = None,
        max_turns: int = 4,
        reward_mode: str = "per_step",
        timeout: float = 600.0,
        model: str = "default",
        **kwargs: Any,
    ):
        if (base_url is None) == (app is None):
            raise ValueError("give exactly one of base_url (a running server) and app")
        if reward_mode not in REWARD_MODES:
            raise ValueError(f"reward_mode={reward_mode!r}; allowed: {list(REWARD_MODES)}")
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns}; must be >= 1")
        if not timeout > 0:
            raise ValueError(f"timeout={timeout}; must be > 0")
        self.base_url = base_url.rstrip("/") if base_url else None
        self.app = app
        self.action_field = action_field
        self.observation_field = observation_field
        self.system_prompt = system_prompt
        self.max_turns = int(max_turns)
        self.reward_mode = reward_mode
        self.timeout = float(timeout)
        self.model = model
        self.sampling = dict(kwargs)
        if "max_completion_tokens" in self.sampling:
            self.sampling["max_tokens"] = self.sampling.pop("max_completion_tokens")
        self.sampling.pop("max_turns", None)

    def server_url(self) -> str:
        return self.base_url or start_server(self.app)

    def render(self, observation: dict[str, Any]) -> str:
        value = observation.get(self.observation_field)
        if isinstance(value, str):
            return value
        rest = {k: v for k, v in observation.items() if k not in ("done", "reward", "metadata")}
        return json.dumps(rest, default=str)

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float | dict[str, float]:
        url = await asyncio.get_running_loop().run_in_executor(None, self.server_url)
        try:
            return await asyncio.wait_for(self._episode(url, data, extra_kwargs), self.timeout)
        except TimeoutError:
            raise TimeoutError(
                f"OpenEnv episode on {url} ran past timeout={self.timeout}s"
            ) from None

    async def _episode(self, url: str, data: dict[str, Any], extra: dict[str, Any]):
        from openai import AsyncOpenAI

        try:
            from openenv.core import GenericEnvClient
        except ImportError as e:
            raise ImportError(
                "areal.workflow.openenv needs openenv-core: pip install 'areal[envs]'"
            ) from e
        client = AsyncOpenAI(
            base_url=extra.get("base_url") or os.getenv("OPENAI_BASE_URL"),
            api_key=extra.get("api_key") or os.getenv("OPENAI_API_KEY"),
            http_client=extra.get("http_client"),
            max_retries=0,
        )
        messages: list[dict[str, Any]] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        rewards: dict[str, float] = {}
        step_rewards: list[float | None] = []
        async with GenericEnvClient(base_url=url) as env:
            result = await env.reset(**dict(data.get("reset") or {}))
            done = bool(result.done)
            while not done and len(rewards) < self.max_turns:
                messages.append({"role": "user", "content": self.render(result.observation)})
                comp = await client.chat.completions.create(
                    model=self.model, messages=messages, **self.sampling
                )
                message = comp.choices[0].message
                messages.append({"role": "assistant", "content": message.content or ""})
                result = await env.step({self.action_field: message.content or ""})
                step_rewards.append(None if result.reward is None else float(result.reward))
                rewards[comp.id] = step_rewards[-1] or 0.0
                done = bool(result.done)
        if not rewards:
            raise ValueError(f"OpenEnv server {url}: the episode ended at reset (no model call)")
        if self.reward_mode == "per_step":
            return rewards
        if all(r is None for r in step_rewards):
            raise ValueError(f"OpenEnv server {url} returned no reward in the whole episode")
        return float(sum(r for r in step_rewards if r is not None))
