"""``MultiTurnWorkflow``: answer, check, and on failure retry with feedback (AReaL's semantics).

One call of ``arun_episode`` is ONE trajectory (the trainer runs it ``gconfig.n_samples``
times per prompt to form a group):

1. the prompt ``data["messages"]`` goes through the chat template (generation prompt on);
2. the model answers; ``reward_fn`` scores the answer (through ``AsyncRewardWrapper``, with
   every data field passed as a keyword argument, like ``RLVRWorkflow``);
3. a reward of exactly ``0`` is a failure: if turns are left, the conversation is extended
   with the answer (an EOS is appended when generation stopped at the length limit) and a
   feedback user turn (:data:`FEEDBACK`), rendered by the chat template, and the model
   answers again on the WHOLE conversation; at most ``max_turns`` answers;
4. the episode reward is the last answer's reward times ``turn_discount ** (turns - 1)``.

The trajectory is one sequence: prompt, answer 1, feedback, answer 2, ... Only the tokens
the model generated have ``loss_mask`` 1 (every assistant token of every turn, its EOS
included); prompt, feedback and appended EOS tokens have ``loss_mask`` 0, logprob 0 and
version -1. Each generated token keeps the weight version that produced it. Token ids are
exactly the server's (each turn's request is the previous sequence plus the feedback ids,
never a re-tokenisation of decoded text).

Output keys (one row, as ``RLVRWorkflow``): ``input_ids``, ``attention_mask``,
``loss_mask``, ``logprobs``, ``versions``, ``rewards`` ``[1]``, ``seqlen`` ``[1]``, ``no_eos``
``[1]`` (the last answer hit the length limit). Stats ``reward`` and ``num_turns`` go to the
rollout stats scope.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from areal.api.io_struct import ModelRequest
from areal.api.workflow_api import RolloutWorkflow
from areal.infra.rollout import workflow_context
from areal.utils import logging
from areal.utils.moe_routing import splice_routing
from areal.utils.seeding import request_seed
from areal.workflow.trajectory import trajectory_tensors

if TYPE_CHECKING:
    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.engine_api import InferenceEngine

logger = logging.getLogger("MultiTurnWorkflow")

FEEDBACK = (
    "Your answer is either wrong or not parsable to the reward function. You may "
    "misunderstand the original question. Please carefully read the original question, "
    "check the previous errors, and try to answer it again."
)
# Reward-function positional arguments; data fields with these names are not forwarded.
_REWARD_POSITIONAL = ("prompt", "completions", "prompt_ids", "completion_ids")


def _as_ids(out: Any) -> list[int]:
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    if isinstance(out, torch.Tensor):
        out = out.tolist()
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(t) for t in out]


def _episode_context() -> tuple[str, int]:
    """(stats scope, position in the group) from the executor's workflow context."""
    return workflow_context.stat_scope(), int(workflow_context.get().sample_index)


def feedback_prompt_ids(tokenizer: Any, feedback: str = FEEDBACK) -> list[int]:
    """Token ids that follow an answer's EOS to add a feedback user turn and a new
    generation prompt, as the chat template renders them (e.g. ChatML:
    ``"\\n<|im_start|>user\\n{feedback}<|im_end|>\\n<|im_start|>assistant\\n"``).

    Taken as the difference of two renderings, so no encode/decode round trip is involved.
    """
    eos = tokenizer.eos_token_id
    answer = [{"role": "assistant", "content": "some answer."}]
    s1 = _as_ids(tokenizer.apply_chat_template(answer, tokenize=True))
    s2 = _as_ids(
        tokenizer.apply_chat_template(
            answer + [{"role": "user", "content": feedback}],
            tokenize=True,
            add_generation_prompt=True,
        )
    )
    if s2[: len(s1)] != s1 or eos not in s1:
        raise ValueError(
            "MultiTurnWorkflow: the chat template is not prefix-stable (rendering a longer "
            "conversation changed the earlier tokens) or has no EOS after an assistant turn; "
            "cannot append feedback turns to generated tokens"
        )
    last_eos = len(s1) - 1 - s1[::-1].index(eos)
    return s2[last_eos + 1 :]


class MultiTurnWorkflow(RolloutWorkflow):
    """Retry with feedback until the reward is non-zero or ``max_turns`` answers were given.

    Args:
        reward_fn: ``reward_fn(prompt, completions, prompt_ids, completion_ids, **data) ->
            float`` (module-level, picklable) or its import string. ``0`` means failure.
        gconfig: sampling parameters of every turn (``max_new_tokens`` per answer,
            ``max_tokens`` for the whole conversation); ``n_samples`` is the trainer's.
        tokenizer: a tokenizer object or a path to load one from.
        max_turns: maximum number of answers, >= 1.
        turn_discount: reward factor per extra turn, in (0, 1].
        feedback: text of the feedback user turn (default: AReaL's).
        rollout_stat_scope: stats tracker name (default: the workflow context's scope).
    """

    def __init__(
        self,
        reward_fn: Callable[..., float] | str,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        max_turns: int,
        turn_discount: float,
        feedback: str = FEEDBACK,
        rollout_stat_scope: str | None = None,
    ):
        from areal.api.reward_api import AsyncRewardWrapper

        if int(max_turns) < 1:
            raise ValueError(f"MultiTurnWorkflow: max_turns={max_turns}; must be >= 1")
        if not 0.0 < float(turn_discount) <= 1.0:
            raise ValueError(f"MultiTurnWorkflow: turn_discount={turn_discount}; must be in (0, 1]")
        if gconfig is None:
            raise ValueError("MultiTurnWorkflow: gconfig is required")
        if tokenizer is None:
            raise ValueError("MultiTurnWorkflow: tokenizer (object or path) is required")
        if isinstance(tokenizer, str | os.PathLike):
            from areal.utils.hf_utils import load_hf_tokenizer

            tokenizer = load_hf_tokenizer(str(tokenizer))
        if tokenizer.eos_token_id is None:
            raise ValueError("MultiTurnWorkflow: the tokenizer has no EOS token")
        stop = set(gconfig.stop_token_ids) | {tokenizer.eos_token_id}
        if tokenizer.pad_token_id is not None:
            stop.add(tokenizer.pad_token_id)
        self.gconfig = gconfig.new(n_samples=1, stop_token_ids=sorted(stop))
        self.reward_fn = reward_fn
        self.tokenizer = tokenizer
        self.max_turns = int(max_turns)
        self.turn_discount = float(turn_discount)
        self.rollout_stat_scope = rollout_stat_scope
        self.async_reward_fn = AsyncRewardWrapper(reward_fn)
        self.multi_turn_prompt_ids = feedback_prompt_ids(tokenizer, feedback)

    async def arun_episode(
        self, engine: InferenceEngine, data: dict[str, Any]
    ) -> dict[str, torch.Tensor] | None:
        if "messages" not in data:
            raise KeyError(
                f"MultiTurnWorkflow: data has no 'messages' field (keys: {sorted(data)})"
            )
        prompt_ids = _as_ids(
            self.tokenizer.apply_chat_template(
                data["messages"], tokenize=True, add_generation_prompt=True
            )
        )
        if not prompt_ids:
            raise ValueError("MultiTurnWorkflow: the prompt tokenized to an empty sequence")
        scope, sample_index = _episode_context()
        version = engine.get_version() if hasattr(engine, "get_version") else 0
        reward_kwargs = {k: v for k, v in data.items() if k not in _REWARD_POSITIONAL}
        skip = self.gconfig.skip_special_tokens
        eos = self.tokenizer.eos_token_id

        seq = list(prompt_ids)
        loss_mask = [0] * len(seq)
        logprobs = [0.0] * len(seq)
        versions = [-1] * len(seq)
        routed = None  # MoE routing per position (rollout.return_routed_experts)
        reward, turns, stop_reason = 0.0, 0, "stop"
        while turns < self.max_turns:
            req = ModelRequest(
                rid=uuid.uuid4().hex,
                input_ids=list(seq),
                gconfig=self.gconfig,
                tokenizer=self.tokenizer,
                metadata={
                    "seed": request_seed(*workflow_context.seed_parts(prompt_ids, version, turns))
                },
            )
            resp = await engine.agenerate(req)
            n = resp.output_len
            if len(resp.output_logprobs) != n or len(resp.output_versions) != n:
                raise ValueError(
                    f"MultiTurnWorkflow: response has {n} tokens but "
                    f"{len(resp.output_logprobs)} logprobs and {len(resp.output_versions)} versions"
                )
            turns += 1
            if resp.routed_experts is not None:
                routed = splice_routing(routed, resp.routed_experts, len(seq), req.rid)
            stop_reason = resp.stop_reason
            seq += list(resp.output_tokens)
            loss_mask += [1] * n
            logprobs += [float(x) for x in resp.output_logprobs]
            versions += [int(v) for v in resp.output_versions]
            reward = float(
                await self.async_reward_fn(
                    self.tokenizer.decode(req.input_ids, skip_special_tokens=skip),
                    self.tokenizer.decode(resp.output_tokens, skip_special_tokens=skip),
                    list(req.input_ids),
                    list(resp.output_tokens),
                    **reward_kwargs,
                )
            )
            if reward != 0.0 or turns >= self.max_turns:
                break
            extra = ([] if resp.output_tokens[-1:] == [eos] else [eos]) + list(
                self.multi_turn_prompt_ids
            )
            if len(seq) + len(extra) >= self.gconfig.max_tokens:
                logger.debug("conversation reached gconfig.max_tokens after %d turns", turns)
                break
            seq += extra
            loss_mask += [0] * len(extra)
            logprobs += [0.0] * len(extra)
            versions += [-1] * len(extra)

        reward *= self.turn_discount ** (turns - 1)
        self._record_stats(reward, turns, len(seq), self.rollout_stat_scope or scope)
        return trajectory_tensors(
            input_ids=seq,
            loss_mask=loss_mask,
            logprobs=logprobs,
            versions=versions,
            reward=reward,
            no_eos=stop_reason == "length",
            routed_experts=routed,
        )

    @staticmethod
    def _record_stats(reward: float, turns: int, seqlen: int, scope: str) -> None:
        from areal.utils import stats_tracker

        stats_tracker.get(scope).scalar(reward=reward, num_turns=float(turns), seqlen=seqlen)
