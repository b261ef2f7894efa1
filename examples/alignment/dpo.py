"""DPO on preference pairs (HH-RLHF files or synthetic arithmetic pairs).

python examples/alignment/dpo.py --config examples/alignment/dpo_cpu.yaml

Prints the held-out metrics before and after training as one JSON line
(``preference_accuracy``: policy logprob of chosen > rejected).
"""

import json
import sys

from areal import DPOTrainer
from areal.api.cli_args import DPOConfig, load_expr_config
from areal.dataset import get_custom_dataset
from areal.utils.hf_utils import load_hf_tokenizer


def main(args):
    config, _ = load_expr_config(args, DPOConfig)
    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    train_dataset = get_custom_dataset("train", config.train_dataset, tokenizer)
    valid_dataset = (
        get_custom_dataset("test", config.valid_dataset, tokenizer)
        if config.valid_dataset is not None
        else None
    )
    with DPOTrainer(config, train_dataset=train_dataset, valid_dataset=valid_dataset) as trainer:
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
