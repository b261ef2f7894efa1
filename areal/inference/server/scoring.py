"""Log-probabilities of given tokens under the server's current weights (``POST /score``).

The built-in server's answer for a teacher served by an inference engine
(``teacher.engine_type: rollout``): ``logprobs[i]`` is ``log p(ids[i] | ids[:i])`` at
``temperature`` (0.0 at position 0), the layout of a training engine's ``compute_logp``.
Runs on the scheduler thread (``GenerationCore.run_command``), between generation steps.
"""

from __future__ import annotations

from typing import Any

import torch


def check_score_request(body: dict[str, Any], vocab_size: int) -> tuple[list[list[int]], float]:
    """The sequences and temperature of a ``/score`` body; ``ValueError`` names the field."""
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        ids = [ids]
    if not isinstance(ids, list) or not ids:
        raise ValueError("'input_ids' must be a non-empty list of token ids or of such lists")
    for row in ids:
        if (
            not isinstance(row, list)
            or not row
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in row)
        ):
            raise ValueError("'input_ids' rows must be non-empty lists of integers")
        if min(row) < 0 or max(row) >= vocab_size:
            raise ValueError(f"'input_ids' has ids outside [0, {vocab_size})")
    temperature = body.get("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature={temperature!r}; allowed: a number > 0")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r}; allowed: a number > 0")
    return ids, float(temperature)


@torch.no_grad()
def score_tokens(model: Any, seqs: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
    """Per-token log-probabilities of each sequence (module docstring), one right-padded
    batched forward."""
    device = next(model.parameters()).device
    lens = torch.tensor([len(s) for s in seqs])
    width = int(lens.max())
    mask = torch.arange(width)[None, :] < lens[:, None]
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    ids[mask] = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    ids, mask = ids.to(device), mask.to(device)
    logits = model(input_ids=ids, attention_mask=mask.long()).logits.float() / temperature
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    logp = torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1) * mask
    rows = logp.cpu().tolist()
    return [row[:n] for row, n in zip(rows, lens.tolist())]
