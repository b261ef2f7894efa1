"""``InteractionCache``: the interactions of one episode, in call order (AReaL's semantics).

- Inserting an interaction links it to its **parent**: among the cached interactions whose
  output is known, the one with the longest ``messages + output_message_list`` that is a
  prefix of the new interaction's ``messages`` (messages compared as dicts in Chat
  Completions form, ``None`` values dropped). Feeding the returned message back
  (``messages.append(completion.choices[0].message)``) therefore links the next call.
- Rewards: :meth:`set_reward` / :meth:`set_last_reward`; :meth:`apply_reward_discount`
  (once per episode) walks the interactions from the newest to the oldest in insertion
  order and sets ``reward[i] = reward[i] + turn_discount * reward[i+1]`` (unset rewards
  count as 0).
- :meth:`export_interactions`: ``"individual"`` returns every finished interaction;
  ``"concat"`` (only when every interaction was made with ``chat_template_type="concat"``,
  whose prompts extend the parent's exact tokens) returns the leaves of the conversation
  tree: one entry per linear conversation, whose ``to_tensor_dict()`` holds all its turns.

The cache is thread-safe for the reward setters; insertion happens on the event loop.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from areal.experimental.openai.types import InteractionWithTokenLogpReward
from areal.utils import logging

logger = logging.getLogger("InteractionCache")

EXPORT_STYLES = ("individual", "concat")


def _is_prefix(a: list[Any], b: list[Any]) -> bool:
    return len(a) <= len(b) and b[: len(a)] == a


class InteractionCache(OrderedDict[str, InteractionWithTokenLogpReward]):
    """Ordered ``{interaction id: interaction}`` of one episode (see module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._apply_reward_discount_called = False
        self._total_reward = 0.0
        self._lock = threading.Lock()

    def __deepcopy__(self, memo):
        if len(self):
            raise TypeError("only an empty InteractionCache can be deep-copied")
        new = InteractionCache()
        memo[id(self)] = new
        return new

    def __reduce__(self):  # picklable despite the lock (e.g. to send exports to a process)
        return (InteractionCache, (list(self.items()),))

    # ------------------------------------------------------------------ insertion
    def __setitem__(self, key: str, value: InteractionWithTokenLogpReward) -> None:
        if value.messages is None:
            raise ValueError("an interaction needs its input messages to find its parent")
        if value.parent is None:
            best = None
            best_len = -1
            for cand in self.values():
                if cand is value or cand.output_message_list is None:
                    continue  # still generating: cannot be a parent
                full = list(cand.messages) + list(cand.output_message_list)
                if len(full) > best_len and _is_prefix(full, value.messages):
                    best, best_len = cand, len(full)
            value.parent = best
        super().__setitem__(key, value)

    # ------------------------------------------------------------------ rewards
    @property
    def last_interaction_id(self) -> str:
        if not self:
            raise KeyError("the interaction cache is empty")
        return next(reversed(self))

    @property
    def total_reward(self) -> float:
        return self._total_reward

    def set_reward(self, interaction_id: str, reward: float) -> None:
        """Set the reward of one interaction (``KeyError`` if the id is unknown)."""
        if interaction_id not in self:
            raise KeyError(f"no interaction with id {interaction_id!r} in the cache")
        with self._lock:
            self._total_reward -= self[interaction_id].reward or 0.0
            self[interaction_id].reward = float(reward)
            self._total_reward += float(reward)

    def set_last_reward(self, reward: float) -> None:
        """Set the reward of the most recent interaction."""
        self.set_reward(self.last_interaction_id, reward)

    def apply_reward_discount(
        self, turn_discount: float = 1.0
    ) -> dict[str, InteractionWithTokenLogpReward]:
        """Propagate rewards backwards in call order (see module docstring); once only."""
        if not 0.0 <= float(turn_discount) <= 1.0:
            raise ValueError(f"turn_discount={turn_discount}; must be in [0, 1]")
        with self._lock:
            if self._apply_reward_discount_called:
                raise RuntimeError("apply_reward_discount may be called only once per episode")
            self._apply_reward_discount_called = True
            items = list(reversed(self.values()))
            if items and items[0].reward is None:
                logger.warning("the last interaction has no reward; using 0.0")
            running = 0.0
            for it in items:
                running = running * float(turn_discount) + (it.reward or 0.0)
                it.reward = running
        return dict(self)

    # ------------------------------------------------------------------ export
    def export_interactions(
        self, style: str, reward_discount: float | None = None
    ) -> dict[str, InteractionWithTokenLogpReward]:
        """Finished interactions, all (``individual``) or conversation leaves (``concat``).

        ``reward_discount``: apply :meth:`apply_reward_discount` first if it was not yet.
        """
        if style not in EXPORT_STYLES:
            raise ValueError(f"export style {style!r}; allowed: {list(EXPORT_STYLES)}")
        if reward_discount is not None and not self._apply_reward_discount_called:
            self.apply_reward_discount(turn_discount=reward_discount)
        done: dict[str, InteractionWithTokenLogpReward] = {}
        for key, it in self.items():
            if it.output_message_list is None or it.interaction_id is None:
                logger.warning("skipping unfinished interaction %s in the export", key)
                continue
            if it.interaction_id != key:
                raise ValueError(f"interaction stored under {key!r} has id {it.interaction_id!r}")
            done[key] = it
        if style == "individual":
            return done
        bad = [k for k, it in done.items() if it.chat_template_type != "concat"]
        if bad:
            raise ValueError(
                "export style 'concat' needs interactions made with "
                f"chat_template_type='concat' ({len(bad)} were not, e.g. {bad[0]!r}): re-applying "
                "a chat template can change earlier tokens, so only concat-mode prompts "
                "extend their parent's exact tokens; use style='individual' instead"
            )
        parents = {id(it.parent) for it in done.values() if it.parent is not None}
        return {k: it for k, it in done.items() if id(it) not in parents}
