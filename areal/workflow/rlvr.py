"""``RLVRWorkflow``: RL with verifiable rewards (one prompt -> one scored answer per call).

One episode (one call of ``arun_episode``), as in AReaL:

1. ``data_extract_prompt_fn(data)`` (default: ``data["messages"]``) and
   ``get_input_ids_fn(prompt, tokenizer, enable_thinking)`` (default: the chat template
   with ``add_generation_prompt=True``) give the prompt token ids;
2. one generation request (``n_samples=1``);
3. the completion is decoded and scored by ``reward_fn`` through ``AsyncRewardWrapper``
   (process pool + timeout; a failing reward is a logged 0.0), with every data field
   passed as a keyword argument (e.g. ``answer``);
4. the result is a padded batch of ONE row: ``input_ids``, ``attention_mask`` (bool),
   ``loss_mask`` (1 on generated tokens), ``logprobs`` (float32, behaviour logprob at each
   generated token), ``versions`` (weight version per generated token, -1 on the prompt
   and padding), ``rewards`` (float32 ``[1]``), ``seqlen`` (long ``[1]``, prompt +
   completion length) and ``no_eos`` (bool ``[1]``, True when generation hit the length
   limit, for overlong penalties / masking).

Groups: the trainer (and ``submit``/``prepare_batch`` with ``group_size``) runs the
episode ``gconfig.n_samples`` times per prompt through
:class:`~areal.infra.grouped_workflow.GroupedRolloutWorkflow` and concatenates the group, so a
group of ``n`` rows is produced exactly once. ``gconfig.n_samples`` is not read here.

Rollout stats (``reward``, ``prompt_len``, ``completion_len``, ``no_eos``) go to the
stats tracker named ``rollout_stat_scope`` (default: ``workflow_context.stat_scope()``,
i.e. ``rollout`` or ``eval-rollout``). With ``dump_dir``, prompt/completion/reward text is
appended to ``{dump_dir}/{version}.jsonl`` in a worker thread (never blocking the event
loop).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from areal.api.io_struct import ModelRequest
from areal.api.workflow_api import RolloutWorkflow
from areal.infra.rollout import workflow_context
from areal.utils import logging
from areal.utils.hf_utils import load_hf_tokenizer
from areal.utils.seeding import request_seed
from areal.workflow.trajectory import single_turn_trajectory

if TYPE_CHECKING:
    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.engine_api import InferenceEngine

logger = logging.getLogger("RLVRWorkflow")

# Reward-function positional arguments; data fields with these names are not forwarded.
_REWARD_POSITIONAL = ("prompt", "completions", "prompt_ids", "completion_ids")
_DUMP_LOCK = threading.Lock()
# Prompts whose token ids (and decoded text) an RLVRWorkflow remembers: the n samples
# of a group tokenize the same prompt, and the chat template costs ~0.15 ms a call.
_PROMPT_CACHE_SIZE = 1024


def default_data_extract_prompt_fn(data: dict[str, Any]) -> Any:
    """The chat messages of a dataset row (``data["messages"]``)."""
    if "messages" not in data:
        raise KeyError(
            f"RLVRWorkflow: data has no 'messages' field (keys: {sorted(data)}); pass "
            "data_extract_prompt_fn to say where the prompt is"
        )
    return data["messages"]


def default_get_input_ids_fn(prompt: Any, tokenizer: Any, enable_thinking: bool) -> list[int]:
    """Chat messages -> ids with the generation prompt; a plain string is just encoded."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    kwargs: dict[str, Any] = dict(tokenize=True, add_generation_prompt=True)
    if enable_thinking:
        kwargs["enable_thinking"] = True
    out = tokenizer.apply_chat_template(prompt, **kwargs)
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    if isinstance(out, torch.Tensor):
        out = out.tolist()
    if out and isinstance(out[0], list):  # batched form
        out = out[0]
    return [int(t) for t in out]


def _append_lines(path: str, lines: list[str]) -> None:
    with _DUMP_LOCK, open(path, "a", encoding="utf-8") as f:
        f.write("".join(lines))


class RLVRWorkflow(RolloutWorkflow):
    """Sample one answer to a prompt and score it with ``reward_fn`` (AReaL's signature).

    Args:
        reward_fn: ``reward_fn(prompt, completions, prompt_ids, completion_ids, **data) ->
            float`` (module-level, picklable) or its import string
            (``"areal.reward.gsm8k.gsm8k_reward_fn"``).
        gconfig: sampling parameters (``n_samples`` is the trainer's business: groups are
            formed by running this workflow ``n_samples`` times).
        tokenizer: a tokenizer object or a path / hub id to load one from.
        enable_thinking: forwarded to the chat template (Qwen3-style thinking).
        get_input_ids_fn: ``(prompt, tokenizer, enable_thinking) -> list[int]`` or its
            import string.
        data_extract_prompt_fn: ``(data) -> prompt`` (messages list or string) or its
            import string.
        rollout_stat_scope: stats tracker name for reward/length stats (default:
            ``workflow_context.stat_scope()``).
        dump_dir: if set, append text dumps to ``{dump_dir}/{version}.jsonl``.
    """

    def __init__(
        self,
        reward_fn: Callable[..., float] | str,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        enable_thinking: bool = False,
        get_input_ids_fn: Callable[[Any, Any, bool], list[int]] | str | None = None,
        data_extract_prompt_fn: Callable[[dict[str, Any]], Any] | str | None = None,
        rollout_stat_scope: str | None = None,
        dump_dir: str | None = None,
    ):
        from areal.api.reward_api import AsyncRewardWrapper
        from areal.utils.dynamic_import import import_from_string

        if gconfig is None:
            raise ValueError("RLVRWorkflow: gconfig is required")
        if tokenizer is None:
            raise ValueError("RLVRWorkflow: tokenizer (object or path) is required")
        if isinstance(tokenizer, str | os.PathLike):
            tokenizer = load_hf_tokenizer(str(tokenizer))
        if isinstance(get_input_ids_fn, str):
            get_input_ids_fn = import_from_string(get_input_ids_fn)
        if isinstance(data_extract_prompt_fn, str):
            data_extract_prompt_fn = import_from_string(data_extract_prompt_fn)
        self.reward_fn = reward_fn
        # As AReaL: generation also stops at the tokenizer's pad and EOS tokens.
        if hasattr(gconfig, "new_with_stop_and_pad_token_ids"):
            gconfig = gconfig.new_with_stop_and_pad_token_ids(tokenizer)
        self.gconfig = gconfig.new(n_samples=1)
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking
        self.rollout_stat_scope = rollout_stat_scope
        self.dump_dir = dump_dir
        self.get_input_ids_fn = get_input_ids_fn or default_get_input_ids_fn
        self.data_extract_prompt_fn = data_extract_prompt_fn or default_data_extract_prompt_fn
        self.async_reward_fn = AsyncRewardWrapper(reward_fn)
        # (JSON of the prompt, skip_special_tokens) -> (ids, decoded prompt); only with
        # the default tokenization (a custom get_input_ids_fn may not be a pure function)
        self._prompt_cache: OrderedDict[tuple[str, bool], tuple[list[int], str]] | None = (
            OrderedDict() if get_input_ids_fn is None else None
        )
        if dump_dir is not None:
            os.makedirs(dump_dir, exist_ok=True)

    async def arun_episode(
        self, engine: InferenceEngine, data: dict[str, Any]
    ) -> dict[str, torch.Tensor] | None:
        skip = self.gconfig.skip_special_tokens
        input_ids, prompt_str = self._tokenize_prompt(self.data_extract_prompt_fn(data), skip)
        ctx = workflow_context.get()
        # Reproducible sampling when a base seed is set (set_random_seed): same prompt,
        # position in the group and policy version -> same seed in every run.
        version = engine.get_version() if hasattr(engine, "get_version") else 0
        req = ModelRequest(
            rid=uuid.uuid4().hex,
            input_ids=list(input_ids),
            gconfig=self.gconfig,
            tokenizer=self.tokenizer,
            metadata={"seed": request_seed(*workflow_context.seed_parts(input_ids, version))},
        )
        resp = await engine.agenerate(req)

        completion = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=skip)
        reward_kwargs = {k: v for k, v in data.items() if k not in _REWARD_POSITIONAL}
        reward = await self.async_reward_fn(
            prompt_str, completion, list(input_ids), list(resp.output_tokens), **reward_kwargs
        )

        batch = single_turn_trajectory(input_ids, resp, reward, owner="RLVRWorkflow")
        p_len, c_len = len(input_ids), resp.output_len
        self._record_stats(float(reward), p_len, c_len, resp.stop_reason == "length")
        if self.dump_dir is not None:
            await self._dump(engine, data, prompt_str, completion, float(reward), resp, ctx)
        return batch

    def _tokenize_prompt(self, prompt: Any, skip_special_tokens: bool) -> tuple[list[int], str]:
        """The prompt's token ids and their decoded text, from the cache when the same
        prompt (equal JSON) was tokenized before with the default tokenization."""
        key = None
        if self._prompt_cache is not None:
            try:
                key = (json.dumps(prompt, sort_keys=True), bool(skip_special_tokens))
            except (TypeError, ValueError):  # not JSON (e.g. images): not cached
                key = None
            hit = self._prompt_cache.get(key) if key is not None else None
            if hit is not None:
                self._prompt_cache.move_to_end(key)
                return list(hit[0]), hit[1]
        input_ids = self.get_input_ids_fn(prompt, self.tokenizer, self.enable_thinking)
        if isinstance(input_ids, dict):
            input_ids = input_ids["input_ids"]
        input_ids = [int(t) for t in input_ids]
        if not input_ids:
            raise ValueError("RLVRWorkflow: the prompt tokenized to an empty sequence")
        prompt_str = self.tokenizer.decode(input_ids, skip_special_tokens=skip_special_tokens)
        if key is not None:
            self._prompt_cache[key] = (list(input_ids), prompt_str)
            if len(self._prompt_cache) > _PROMPT_CACHE_SIZE:
                self._prompt_cache.popitem(last=False)
        return input_ids, prompt_str

    def _record_stats(self, reward: float, prompt_len: int, completion_len: int, no_eos: bool):
        from areal.utils import stats_tracker

        scope = self.rollout_stat_scope or workflow_context.stat_scope()
        # no await inside: per-thread scopes are not shared between coroutines
        stats_tracker.get(scope).scalar(
            reward=reward,
            prompt_len=prompt_len,
            completion_len=completion_len,
            no_eos=float(no_eos),
        )

    async def _dump(self, engine, data, prompt_str, completion, reward, resp, ctx) -> None:
        try:
            version = int(engine.get_version())
        except NotImplementedError:
            version = 0
        qid = next((data[k] for k in ("query_id", "id", "qid") if data.get(k) is not None), None)
        qid = str(qid) if qid is not None else uuid.uuid4().hex
        line = json.dumps(
            dict(
                qid=qid,
                version=version,
                idx=ctx.sample_index,
                prompt=prompt_str,
                completion=completion,
                reward=reward,
                seqlen=resp.input_len + resp.output_len,
                stop_reason=resp.stop_reason,
            ),
            ensure_ascii=False,
        )
        path = os.path.join(self.dump_dir, f"{version}.jsonl")
        try:
            await asyncio.to_thread(_append_lines, path, [line + "\n"])
        except OSError as e:
            logger.warning("Could not dump rollouts to %s: %s", path, e)
