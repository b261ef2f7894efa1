"""Reward-model training on preference pairs (HH-RLHF files or synthetic arithmetic pairs).

python examples/alignment/rw.py --config examples/alignment/rw_cpu.yaml

Prints the held-out pair accuracy (reward of chosen > rejected) before and after training
as one JSON line.
"""

import json
import sys

from areal import RWTrainer
from areal.api.cli_args import RWConfig, load_expr_config
from areal.dataset import get_custom_dataset
from areal.utils.hf_utils import load_hf_tokenizer


def main(args):
    config, _ = load_expr_config(args, RWConfig)
    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    train_dataset = get_custom_dataset("train", config.train_dataset, tokenizer)
    valid_dataset = (
        get_custom_dataset("test", config.valid_dataset, tokenizer)
        if config.valid_dataset is not None
        else None
    )
    with RWTrainer(config, train_dataset=train_dataset, valid_dataset=valid_dataset) as trainer:
        before = trainer.evaluate()
        result = trainer.train()
        after = trainer.evaluate()
    print(
        json.dumps(
            {
                "steps": len(result["losses"]),
                "first_loss": result["losses"][0] if result["losses"] else None,
                "last_loss": result["losses"][-1] if result["losses"] else None,
                "heldout_before": before,
                "heldout_after": after,
                "log_dir": result["log_dir"],
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
