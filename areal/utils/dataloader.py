"""Resumable dataloaders (torchdata ``StatefulDataLoader``) that yield lists of dicts.

``create_dataloader(dataset, dataset_config, rank, world_size, seed)`` shards the dataset
over ``world_size`` ranks, shuffles with ``seed + epoch`` (the epoch advances by itself
each time the loader is exhausted, so iterating again gives a new order), batches by
``dataset_config.batch_size`` and collates a batch into a plain ``list`` of row dicts
(AReaL style; workflows take one row each).

``loader.state_dict()`` / ``loader.load_state_dict(sd)`` resume mid-epoch: a fresh
loader built with the same arguments and loaded with the state yields exactly the
remaining batches of that epoch, then continues with the next epoch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

if TYPE_CHECKING:
    from areal.api.dataset_config import DatasetConfig

__all__ = ["ResumableDistributedSampler", "create_dataloader", "list_collate"]


def list_collate(batch: list[Any]) -> list[Any]:
    """Collate function that keeps a batch as a list of rows (dicts)."""
    return list(batch)


class ResumableDistributedSampler(StatefulDistributedSampler):
    """``StatefulDistributedSampler`` that also saves the epoch and advances it itself.

    Each complete pass ends with ``epoch += 1``, so an outer loop that simply iterates
    the loader again gets a new shuffle; ``state_dict`` holds ``epoch`` and ``yielded``.
    """

    _EPOCH = "epoch"

    def __iter__(self):
        epoch = self.epoch
        yield from super().__iter__()
        if self.epoch == epoch:  # not changed by an explicit set_epoch meanwhile
            self.set_epoch(epoch + 1)
            self.yielded = 0

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd[self._EPOCH] = self.epoch
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.epoch = int(state_dict.get(self._EPOCH, self.epoch))


def create_dataloader(
    dataset: Any,
    dataset_config: DatasetConfig | int | None = None,
    rank: Any = 0,
    world_size: Any = 1,
    seed: Any = None,
    collate_fn=None,
) -> StatefulDataLoader:
    """A resumable, sharded ``StatefulDataLoader`` over ``dataset``.

    Reads ``batch_size``, ``shuffle``, ``drop_last``, ``num_workers`` and ``pin_memory``
    from ``dataset_config`` (a ``DatasetConfig``). ``rank``/``world_size`` shard the rows (each
    rank gets a disjoint slice of every epoch's permutation). ``seed`` defaults to the
    base seed of :func:`areal.utils.seeding.set_random_seed` (0 when unset);
    ``collate_fn`` to :func:`list_collate`.

    AReaL's positional order ``create_dataloader(dataset, rank, world_size,
    dataset_config, collate_fn)`` is accepted too (recognised by an int second argument).
    """
    if isinstance(dataset_config, int) and not isinstance(dataset_config, bool):
        # AReaL's order: (dataset, rank, world_size, dataset_config, collate_fn)
        dataset_config, rank, world_size, collate_fn, seed = (
            world_size,
            dataset_config,
            rank,
            seed,
            None,
        )
    if dataset_config is None:
        raise ValueError("create_dataloader needs dataset_config (batch_size, shuffle, ...)")
    if seed is None:
        from areal.utils.seeding import get_base_seed

        seed = get_base_seed() or 0
    if collate_fn is None:
        collate_fn = list_collate
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}, world_size={world_size}; need 0 <= rank < world_size")
    batch_size = int(dataset_config.batch_size)
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}; must be >= 1")
    drop_last = bool(dataset_config.drop_last)
    if len(dataset) == 0:
        raise ValueError("cannot build a dataloader over an empty dataset")
    sampler = ResumableDistributedSampler(
        dataset,
        num_replicas=world_size,
        rank=rank,
        shuffle=bool(dataset_config.shuffle),
        seed=seed,
        drop_last=drop_last,
    )
    if drop_last and len(sampler) < batch_size:
        raise ValueError(
            f"dataset has {len(sampler)} rows per rank, fewer than batch_size={batch_size} "
            "with drop_last=True: the dataloader would be empty"
        )
    num_workers = int(dataset_config.num_workers)
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_fn,
        drop_last=drop_last,
        pin_memory=bool(dataset_config.pin_memory),
        multiprocessing_context="spawn" if num_workers > 0 else None,
    )
