"""A distillation teacher served by built-in inference servers (``teacher.engine_type:
rollout`` with a ``teacher.rollout.backend`` of ``local:dN``).

``ServerTeacher.launch(teacher_config)`` starts ``N`` built-in servers of
``teacher.path``; ``compute_logp(batch)`` sends the rows of a right-padded batch to their
``POST /score`` (split over the servers) and returns the ``[B, T]`` teacher log-probabilities
in a training engine's layout (``logprobs[b, i]`` scores ``input_ids[b, i]``, 0 at
padding and position 0), at ``teacher.temperature``; ``destroy()`` stops the servers.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests
import torch

from areal.utils import logging

logger = logging.getLogger("ServerTeacher")


def teacher_backend(teacher_config: Any) -> str | None:
    """``teacher.rollout.backend`` (a mapping or a config object), or None."""
    section = teacher_config.rollout
    if section is None:
        return None
    backend = section.get("backend") if isinstance(section, Mapping) else section.backend
    return str(backend) if backend else None


def uses_server_teacher(teacher_config: Any) -> bool:
    """Whether the teacher is scored by built-in servers (module docstring)."""
    if teacher_config is None or teacher_config.engine_type != "rollout":
        return False
    backend = teacher_backend(teacher_config)
    return backend is not None and backend.split(":", 1)[0] == "local"


class ServerTeacher:
    """Teacher log-probabilities from built-in servers' ``/score`` (module docstring)."""

    def __init__(
        self, addresses: list[str], temperature: float = 1.0, timeout: float = 600.0, group=None
    ):
        if not addresses:
            raise ValueError("ServerTeacher needs at least one server address")
        self.addresses = list(addresses)
        self.temperature = float(temperature)
        self.timeout = timeout
        self._group = group
        self._session = requests.Session()

    @classmethod
    def launch(cls, teacher_config: Any, timeout: float = 300.0) -> ServerTeacher:
        from areal.api.alloc_mode import ParallelStrategy
        from areal.inference.server.launch import launch_local_server

        backend = teacher_backend(teacher_config)
        alloc = ParallelStrategy.parse_backend(backend, "teacher.rollout.backend")
        group = launch_local_server(
            teacher_config.path,
            num_servers=alloc.parallel.dp_size,
            server_args={"dtype": teacher_config.dtype},
            timeout=timeout,
        )
        logger.info("teacher %s served by %s", teacher_config.path, group.addresses)
        return cls(group.addresses, temperature=teacher_config.temperature, group=group)

    def _score(self, addr: str, seqs: list[list[int]]) -> list[list[float]]:
        r = self._session.post(
            f"http://{addr}/score",
            json={"input_ids": seqs, "temperature": self.temperature},
            timeout=self.timeout,
        )
        if r.status_code != 200:
            raise RuntimeError(f"teacher server {addr} /score: HTTP {r.status_code}: {r.text}")
        return r.json()["logprobs"]

    def compute_logp(self, batch: dict[str, Any]) -> torch.Tensor:
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()
        lens = mask.sum(dim=1).tolist()
        rows = ids.tolist()
        seqs = [row[:n] for row, n in zip(rows, lens)]
        n = len(self.addresses)
        chunks = [list(range(i, len(seqs), n)) for i in range(n)]
        with ThreadPoolExecutor(max_workers=n) as pool:
            answers = list(
                pool.map(
                    lambda a_c: self._score(a_c[0], [seqs[j] for j in a_c[1]]) if a_c[1] else [],
                    zip(self.addresses, chunks),
                )
            )
        flat = torch.tensor(
            [v for chunk, ans in zip(chunks, answers) for _, row in zip(chunk, ans) for v in row],
            dtype=torch.float32,
        )
        order = torch.tensor([j for chunk in chunks for j in chunk], dtype=torch.long)
        out = torch.zeros(ids.shape, dtype=torch.float32)
        # rows in server order: scatter each row's values to its (row, position) slots
        row_of = torch.repeat_interleave(order, torch.tensor([lens[j] for j in order.tolist()]))
        pos = torch.cat([torch.arange(lens[j]) for j in order.tolist()]) if len(order) else order
        out[row_of, pos] = flat
        return out

    def destroy(self) -> None:
        if self._group is not None:
            self._group.shutdown()
            self._group = None
        self._session.close()
