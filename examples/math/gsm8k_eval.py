"""Evaluate a checkpoint on GSM8K-format math with inference servers only (no training).

As in AReaL's evaluation tutorial: the servers named by ``rollout.backend`` are started
through the scheduler (``RemoteXxxEngine.as_controller(config.rollout, scheduler)``),
every row is submitted with the RLVR workflow, and the rollout statistics are printed::

    python examples/math/gsm8k_eval.py --config examples/math/gsm8k_eval_cpu.yaml   # CPU
    python examples/math/gsm8k_eval.py --config examples/math/gsm8k_grpo.yaml \\
        scheduler.type=local actor.path=/path/to/checkpoint rollout.backend=vllm:d1

``rollout.backend`` may be ``local:dN`` (built-in server), ``vllm:...`` or ``sglang:...``.
The last line printed is ``accuracy: <mean reward>`` (GSM8K reward: 1 correct, 0 not).
"""

import sys

from areal.api.alloc_mode import ModelAllocation
from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.dataset import get_custom_dataset
from areal.engine import RemoteLocalEngine, RemoteSGLangEngine, RemotevLLMEngine
from areal.trainer.common import make_scheduler
from areal.utils import logging, seeding
from areal.utils.dataloader import create_dataloader
from areal.utils.hf_utils import load_hf_tokenizer
from areal.utils.printing import tabulate_stats

logger = logging.getLogger("GSM8KEval")


def main(args):
    config, _ = load_expr_config(args, GRPOConfig)
    logging.setup_file_logging(config.cluster.fileroot, "eval.log")

    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    seeding.set_random_seed(config.seed, key="eval")

    rollout_alloc = ModelAllocation.from_str(config.rollout.backend, name="rollout")
    scheduler = make_scheduler(config)  # scheduler.type: local | ray | slurm

    valid_dataset = get_custom_dataset(
        split="test", dataset_config=config.valid_dataset, tokenizer=tokenizer
    )
    valid_dataloader = create_dataloader(
        valid_dataset, rank=0, world_size=1, dataset_config=config.valid_dataset
    )

    # Evaluation never waits for a newer policy version.
    config.rollout.max_head_offpolicyness = int(1e12)

    par = rollout_alloc.parallel
    # The flags of one server: every field of config.sglang / config.vllm
    # (SGLangConfig.build_args / vLLMConfig.build_args) with the model defaulting to
    # actor.path (and, on CPU, vLLM's block size / chunked prefill adjusted).
    if rollout_alloc.backend == "sglang":
        engine_cls = RemoteSGLangEngine
    elif rollout_alloc.backend == "vllm":
        engine_cls = RemotevLLMEngine
    elif rollout_alloc.backend == "local":
        engine_cls = RemoteLocalEngine
    else:
        raise ValueError(f"Invalid backend: {rollout_alloc.backend}")
    server_args = engine_cls.build_server_args(config, tp_size=par.tp_size, pp_size=par.pp_size)

    eval_rollout = engine_cls.as_controller(config.rollout, scheduler)
    try:
        eval_rollout.initialize(
            role="eval-rollout", server_args=server_args, alloc_mode=rollout_alloc
        )

        workflow = "areal.workflow.rlvr.RLVRWorkflow"
        workflow_kwargs = dict(
            reward_fn="areal.reward.gsm8k.gsm8k_reward_fn",
            gconfig=config.gconfig,
            tokenizer=config.tokenizer_path,
            enable_thinking=False,
        )

        cnt = 0
        for data in valid_dataloader:
            for item in data:
                eval_rollout.submit(
                    item,
                    workflow=workflow,
                    workflow_kwargs=workflow_kwargs,
                    group_size=config.gconfig.n_samples,
                )
                cnt += 1

        eval_rollout.wait(cnt, timeout=None)
        eval_stats = eval_rollout.export_stats()
        logger.info(f"Evaluation Results: {tabulate_stats(eval_stats)}")
        print(f"evaluated: {cnt} prompts x {config.gconfig.n_samples} samples")
        print(f"accuracy: {eval_stats['rollout/reward']:.4f}")
    finally:
        eval_rollout.destroy()
        scheduler.delete_workers(None)


if __name__ == "__main__":
    main(sys.argv[1:])
