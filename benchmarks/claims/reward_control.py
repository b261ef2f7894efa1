"""Run an example script with its training rewards replaced: the claims' controls.

    python benchmarks/claims/reward_control.py --rewards shuffled SCRIPT [ARGS...]
    python benchmarks/claims/reward_control.py --rewards constant SCRIPT [ARGS...]

What happens, in order:

1. ``PPOTrainer.__enter__`` is wrapped so that, once the trainer is built, its
   ``actor.compute_advantages`` permutes (``shuffled``) or replaces by a constant
   (``constant``) the reward of every training batch before the advantages are computed
   (the same hook as ``examples/vlm/clevr_count_grpo.py --shuffle-rewards``).
2. ``SCRIPT`` runs unchanged as ``__main__`` with ``ARGS`` (``runpy``): its config, its
   datasets, its evaluation (always scored against the true answers).

``shuffled`` keeps each batch's reward rate and removes the link between a completion and
its reward (agent batches, one row per model call, are permuted by episode: the rows of an
episode keep one reward between them, as in the true run), so whatever the held-out
accuracy does then is drift, not learning.
``constant`` (every reward 1.0) gives every group zero advantage: the deliberate break
that ``benchmarks/claims/run.py --break demo`` uses to show the claims fail without a signal.
"""

import argparse
import runpy
import sys

import torch

from areal import PPOTrainer
from areal.utils.rl_statistics import episode_first_rows


class RewardOverride:
    """Wraps ``compute_advantages``: each batch's ``rewards`` are permuted or made constant."""

    def __init__(self, compute_advantages, mode: str, seed: int):
        self.compute_advantages = compute_advantages
        self.mode = mode
        self.generator = torch.Generator().manual_seed(seed)

    def shuffle(self, rewards: torch.Tensor, episode_ids: torch.Tensor | None) -> torch.Tensor:
        """Permute ``rewards`` ``[B]`` across episodes: with ``episode_ids`` (agent rows, one
        per model call) every row of an episode gets the reward of the same other episode,
        so an episode's calls stay credited alike, as in the true run; else across rows."""
        if episode_ids is None:
            return rewards[torch.randperm(rewards.shape[0], generator=self.generator)]
        first, episode_of_row = episode_first_rows(torch.as_tensor(episode_ids))
        per_episode = rewards[first]
        perm = torch.randperm(per_episode.shape[0], generator=self.generator)
        return per_episode[perm][episode_of_row]

    def __call__(self, batch, *args, **kwargs):
        rewards = batch["rewards"]  # on a BatchRef: fetches this one tensor from the workers
        if self.mode == "shuffled":
            episodes = batch["episode_ids"] if "episode_ids" in batch else None
            rewards = self.shuffle(rewards, episodes)
        else:
            rewards = torch.ones_like(rewards)
        if isinstance(batch, dict):
            return self.compute_advantages({**batch, "rewards": rewards}, *args, **kwargs)
        batch["rewards"] = rewards  # a BatchRef: only the rewards go back to the workers
        return self.compute_advantages(batch, *args, **kwargs)


def install(mode: str) -> None:
    """Make every ``PPOTrainer`` built from now on train on ``mode`` rewards."""
    enter = PPOTrainer.__enter__

    def entered(trainer):
        trainer = enter(trainer)
        trainer.actor.compute_advantages = RewardOverride(
            trainer.actor.compute_advantages, mode, seed=trainer.config.seed
        )
        return trainer

    PPOTrainer.__enter__ = entered


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rewards", choices=("shuffled", "constant"), required=True)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    install(ns.rewards)
    print(f"training rewards: {ns.rewards.upper()} (control)", flush=True)
    sys.argv = [ns.script, *ns.args]
    runpy.run_path(ns.script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
