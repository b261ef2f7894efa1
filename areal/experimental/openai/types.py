"""``InteractionWithTokenLogpReward``: one recorded model call (AReaL's name and fields).

An interaction holds what the agent saw (``messages`` in Chat Completions form, the
OpenAI object returned: ``completion`` or ``response``), what the engine did
(``model_response``: the exact input/output token ids, logprobs and per-token weight
versions) and the RL bookkeeping (``reward``, ``parent``: the earlier interaction whose
messages plus output are a prefix of this one's messages).

:meth:`InteractionWithTokenLogpReward.to_tensor_dict` turns it into one training row
(shape ``[1, L]``; ``rewards`` and ``no_eos`` shape ``[1]``):

- ``input_ids`` = the engine's input tokens + output tokens, unchanged;
- ``loss_mask`` 1 exactly on the output tokens, ``logprobs`` / ``versions`` the engine's
  values there (0.0 / -1 elsewhere); ``attention_mask`` all True;
- ``rewards`` the interaction's reward (0.0 when unset); ``no_eos`` True when the
  generation hit the length limit.

With ``chat_template_type == "concat"`` and a parent, the row extends the parent's row
(computed recursively): the parent's tokens keep their own loss mask, logprobs and
versions, and only the tokens added since (the new user/tool turns: mask 0) and this
output (mask 1) are appended. The leaf of a linear conversation therefore carries every
turn in one sequence whose loss mask covers exactly the generated tokens. If the child's
input does not start with the parent's tokens (which the client's concat mode
guarantees), the parent is ignored with a warning and the row is built as above.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from areal.utils import logging

if TYPE_CHECKING:
    import torch

    from areal.api.io_struct import ModelResponse

logger = logging.getLogger("InteractionTypes")


class ApiType(StrEnum):
    """Which OpenAI API produced an interaction."""

    COMPLETION = "completion"
    RESPONSE = "response"
    NONE = "none"


@dataclass
class InteractionWithTokenLogpReward:
    """One chat completion / response with its tokens, logprobs, versions and reward."""

    model_response: ModelResponse | None = None
    reward: float | None = None
    parent: InteractionWithTokenLogpReward | None = None
    chat_template_type: str = "hf"
    _cache: dict[str, Any] | None = None

    # Chat Completions form of the input, and of the output (used to find parents).
    messages: list[dict] = field(default_factory=list)
    output_message_list: list[dict] | None = None

    completion: Any = None  # openai.types.chat.ChatCompletion
    response: Any = None  # openai.types.responses.Response
    input_data: Any = ""  # the Responses API ``input`` as given

    _interaction_id: str | None = None

    # ------------------------------------------------------------------ identity
    @property
    def has_tensor_data(self) -> bool:
        return self.model_response is not None or self._cache is not None

    @property
    def is_completion(self) -> bool:
        return self.completion is not None

    @property
    def is_response(self) -> bool:
        return self.response is not None

    @property
    def api_type(self) -> ApiType:
        if self.is_completion:
            return ApiType.COMPLETION
        if self.is_response:
            return ApiType.RESPONSE
        return ApiType.NONE

    @property
    def interaction_id(self) -> str | None:
        if self.is_completion:
            return self.completion.id
        if self.is_response:
            return self.response.id
        return self._interaction_id

    @interaction_id.setter
    def interaction_id(self, value: str) -> None:
        if self.is_completion or self.is_response:
            raise ValueError("the id of a completion/response is its own id; it cannot be set")
        self._interaction_id = value

    @property
    def created_at(self) -> float | None:
        if self.is_completion:
            return float(self.completion.created)
        if self.is_response:
            return float(self.response.created_at)
        return None

    @property
    def current_data(self) -> Any:
        if self.is_completion:
            return self.messages
        if self.is_response:
            return self.input_data
        return None

    @property
    def parent_data(self) -> Any:
        return None if self.parent is None else self.parent.current_data

    @property
    def remaining_messages(self) -> list[dict]:
        """The messages added since the parent's messages and output."""
        if self.parent is None:
            return self.messages
        if self.parent.output_message_list is None:
            raise ValueError("the parent interaction has no output yet")
        return self.messages[len(self.parent.messages) + len(self.parent.output_message_list) :]

    # ------------------------------------------------------------------ tokens
    def full_tokens(self) -> list[int]:
        """Input + output token ids exactly as the engine saw and produced them."""
        resp = self._require_response()
        return list(resp.input_tokens) + list(resp.output_tokens)

    def _require_response(self) -> ModelResponse:
        if self.model_response is None:
            raise ValueError(f"interaction {self.interaction_id} has no model response")
        return self.model_response

    def to_tensor_dict(self) -> dict[str, torch.Tensor]:
        """One training row (see the module docstring); cached after the first call except
        for ``rewards``, which always reflects the current ``reward``."""
        import torch

        if self._cache is None:
            resp = self._require_response()
            n_in, n_out = len(resp.input_tokens), len(resp.output_tokens)
            if len(resp.output_logprobs) != n_out or len(resp.output_versions) != n_out:
                raise ValueError(
                    f"interaction {self.interaction_id}: {n_out} output tokens but "
                    f"{len(resp.output_logprobs)} logprobs and {len(resp.output_versions)} versions"
                )
            ids = self.full_tokens()
            head_mask: list[int] = []
            head_lp: list[float] = []
            head_ver: list[int] = []
            if self.chat_template_type == "concat" and self.parent is not None:
                parent = self.parent.to_tensor_dict()
                p_ids = parent["input_ids"][0].tolist()
                if len(p_ids) < n_in and list(resp.input_tokens[: len(p_ids)]) == p_ids:
                    head_mask = parent["loss_mask"][0].tolist()
                    head_lp = parent["logprobs"][0].tolist()
                    head_ver = parent["versions"][0].tolist()
                else:
                    logger.warning(
                        "interaction %s: its input does not extend its parent %s's tokens; "
                        "the parent's tokens are masked out of this row",
                        self.interaction_id,
                        self.parent.interaction_id,
                    )
            pad = n_in - len(head_mask)
            self._cache = dict(
                input_ids=torch.tensor([ids], dtype=torch.long),
                attention_mask=torch.ones((1, len(ids)), dtype=torch.bool),
                loss_mask=torch.tensor([head_mask + [0] * pad + [1] * n_out], dtype=torch.long),
                logprobs=torch.tensor(
                    [head_lp + [0.0] * pad + [float(x) for x in resp.output_logprobs]],
                    dtype=torch.float32,
                ),
                versions=torch.tensor(
                    [head_ver + [-1] * pad + [int(v) for v in resp.output_versions]],
                    dtype=torch.long,
                ),
                no_eos=torch.tensor([resp.stop_reason == "length"], dtype=torch.bool),
            )
        out = dict(self._cache)
        out["rewards"] = torch.tensor(
            [0.0 if self.reward is None else float(self.reward)], dtype=torch.float32
        )
        return out
