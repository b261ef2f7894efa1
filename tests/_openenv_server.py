"""A small OpenEnv server written with openenv's public API, for the tests.

``ArithEnv``: ``reset(seed)`` poses one of the tiny model's arithmetic word problems;
``step(ArithAction(message=...))`` rewards 1.0 when the message's ``#### N`` is the
answer (done), else 0.0 and asks again ("Wrong, try again: ..."), done after 2 tries.
Run with ``uvicorn _openenv_server:app``.
"""

from __future__ import annotations

import re
import uuid

from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

from areal.dataset.synthetic import ArithSpec, generate_arith_problems

MAX_TRIES = 2


class ArithAction(Action):
    message: str


class ArithObservation(Observation):
    prompt: str = ""


class ArithEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self._problem: dict = {}

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs):
        spec = ArithSpec(digits=1, steps=2, n=1, seed=int(seed or 0))
        self._problem = generate_arith_problems(spec, "openenv")[0]
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return ArithObservation(prompt=self._problem["question"], done=False, reward=None)

    def step(self, action: ArithAction, **kwargs):
        self._state.step_count += 1
        found = re.findall(r"####\s*(-?\d+)", action.message)
        right = bool(found) and int(found[-1]) == self._problem["result"]
        done = right or self._state.step_count >= MAX_TRIES
        prompt = "" if done else "Wrong, try again: " + self._problem["question"]
        return ArithObservation(prompt=prompt, done=done, reward=1.0 if right else 0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(ArithEnv, ArithAction, ArithObservation, max_concurrent_envs=64)
