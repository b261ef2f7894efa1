"""SFT on GSM8K-format data (chat prompt -> full solution).

python examples/math/gsm8k_sft.py --config examples/math/gsm8k_sft_cpu.yaml
"""

import sys

from areal import SFTTrainer
from areal.api.cli_args import SFTConfig, load_expr_config
from areal.dataset import get_custom_dataset
from areal.utils.hf_utils import load_hf_tokenizer


def main(args):
    config, _ = load_expr_config(args, SFTConfig)
    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    train_dataset = get_custom_dataset("train", config.train_dataset, tokenizer)
    valid_dataset = (
        get_custom_dataset("test", config.valid_dataset, tokenizer)
        if config.valid_dataset is not None
        else None
    )
    with SFTTrainer(config, train_dataset=train_dataset, valid_dataset=valid_dataset) as trainer:
        result = trainer.train()
    losses = result["losses"]
    if losses:
        print(f"SFT loss: first {losses[0]:.4f} -> last {losses[-1]:.4f} over {len(losses)} steps")
    print(f"logs: {result['log_dir']}")


if __name__ == "__main__":
    main(sys.argv[1:])
