"""Run a preference example (DPO, RW) with its training labels shuffled: their control.

    python benchmarks/claims/label_control.py SCRIPT [ARGS...]

What happens, in order:

1. ``areal.dataset.get_custom_dataset`` is wrapped so that the training split of a
   preference dataset (rows with ``chosen_*`` / ``rejected_*`` columns) comes back with
   chosen and rejected swapped in a seeded random half of its pairs (every
   ``chosen_X`` column with its ``rejected_X``); other splits are untouched, so the
   held-out figure is still scored against the true preferences.
2. ``SCRIPT`` runs unchanged as ``__main__`` with ``ARGS`` (``runpy``).

The label then says nothing about which answer is right (each pair's order is a coin
flip), so whatever the held-out accuracy does is drift, not learning: the DPO and RW
claims' control. The seed is the run's ``seed=N`` override when it has one, else 1.
"""

from __future__ import annotations

import argparse
import runpy
import sys

import torch


def swap_mask(n: int, seed: int) -> list[bool]:
    """Which of ``n`` pairs swap (each with probability 1/2, seeded)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g) < 0.5).tolist()


def shuffle_labels(dataset, seed: int):
    """``dataset`` (a ``datasets.Dataset`` of pairs) with chosen/rejected swapped in a seeded
    random half of its rows; a dataset without ``chosen_*`` columns is returned as is."""
    cols = [c for c in dataset.column_names if c.startswith("chosen_")]
    pairs = [(c, "rejected_" + c[len("chosen_") :]) for c in cols]
    pairs = [(c, r) for c, r in pairs if r in dataset.column_names]
    if not pairs:
        return dataset
    swap = swap_mask(len(dataset), seed)

    def flip(row, idx):
        if not swap[idx]:
            return row
        out = dict(row)
        for c, r in pairs:
            out[c], out[r] = row[r], row[c]
        return out

    return dataset.map(flip, with_indices=True)


def seed_of(args: list[str], default: int = 1) -> int:
    """The ``seed=N`` override among the script's arguments (the last one wins)."""
    seeds = [a.split("=", 1)[1] for a in args if a.startswith("seed=")]
    return int(seeds[-1]) if seeds else default


def install(seed: int) -> None:
    """Make ``areal.dataset.get_custom_dataset`` shuffle the labels of training pairs."""
    import areal.dataset as datasets_module

    build = datasets_module.get_custom_dataset

    def get_custom_dataset(split=None, dataset_config=None, *args, **kwargs):
        ds = build(split, dataset_config, *args, **kwargs)
        configured = dataset_config.split if dataset_config is not None else None
        effective = split or configured or "train"
        return shuffle_labels(ds, seed) if effective == "train" else ds

    datasets_module.get_custom_dataset = get_custom_dataset


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    seed = seed_of(ns.args)
    install(seed)
    print(f"training labels: SHUFFLED (control; seed {seed})", flush=True)
    sys.argv = [ns.script, *ns.args]
    runpy.run_path(ns.script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
