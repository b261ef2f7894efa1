"""areal's asynchronous GRPO vs TRL's ``GRPOTrainer``, side by side, same wall time.

    pip install -e '.[bench]'          # trl==1.16.0
    python benchmarks/bench_vs_trl.py [--setting demo|longtail|both] [--seconds 300]

Both sides train the embedded ``tiny-base`` model on the same synthetic data (train
n=20000 seed 0, held-out n=512 seed 12345), 16 prompts x 8 samples per step, lr 5e-5
(AdamW betas 0.9/0.99, no weight decay, gradient clipping 1.0), clip 0.2, no KL, T=1.0,
the same reward (``areal.reward.gsm8k.gsm8k_reward_fn``: the final answer equals the gold
one), fp32, and the whole machine: TRL runs with the faster of 1 and all-cores torch
threads (probed per setting right before its run, ``--threads`` to fix it; on a busy
2-core machine two threads can be 10x slower than one), areal's server and trainer
processes share the same cores. The runs go one after the other in this process;
``--trl-runs around`` runs TRL both before and after areal's side and compares areal
with the faster of the two TRL runs (TRL's rate moves with the machine's load).

Clocks start at the first training step (start-up is reported separately) and stop the
run after ``--seconds`` of training. At the first step boundary after each checkpoint
(``--checkpoints``, default 60/150/300 s) the clock is stopped, the held-out set is
scored with greedy decoding (areal: through its inference server with rollout paused;
TRL: ``model.generate`` on left-padded batches), and the clock restarts.

Settings:

- ``demo``: the CPU demo's task (examples/math/gsm8k_grpo_cpu.yaml): 1-digit, 2-step
  problems, 48 new tokens.
- ``longtail``: problems of 1 to 6 steps mixed in every batch (1 digit), 128 new tokens:
  prompts of ~30 to ~85 tokens and completions of 4 to 30+, so sequence lengths vary
  several-fold within a batch (the JSON reports the measured spread).

``--dynamic-sampling on|off|both``: areal's dynamic sampling (default on, the demo's
setting: groups whose samples all got the same reward are not trained); ``off`` trains
every group as TRL does; ``both`` runs areal twice per setting against one TRL run.

JSON per setting: for both sides trained and generated samples/s and tokens/s, steps,
start-up seconds, held-out accuracy before training and at each checkpoint (with the
training time it was taken at), and the ratios (areal / TRL) with each accuracy delta's
binomial standard error; with dense ``--checkpoints`` (e.g. every 30 s) also each side's
accuracy over the second half of the run (mean, spread, and the change between
consecutive evaluations: how far the policy's greedy answers move from one checkpoint
to the next once training has levelled off). Extra ``key=value`` arguments after ``--``
are configuration overrides of areal's side.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MODEL = os.path.join(REPO, "areal/models/assets/tiny-base")
REAL_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # `make real-model` caches it
TRAIN_N, TRAIN_SEED, EVAL_SEED = 20000, 0, 12345
GROUP = 8

# The tiny model's settings share the demo config and geometry; ``real`` is the real-model
# recipe (examples/math/smollm2_grpo_cpu.yaml) and its geometry, applied to both sides.
_TINY = {"model": MODEL, "config": "examples/math/gsm8k_grpo_cpu.yaml", "prompts": 16,
         "lr": 5e-5, "warmup_steps": 10, "temperature": 1.0, "eval_n": 512, "minibatches": 1}  # fmt: skip
SETTINGS: dict[str, dict[str, Any]] = {
    "demo": {**_TINY, "steps": [2], "digits": 1, "max_new_tokens": 48},
    "longtail": {**_TINY, "steps": [1, 2, 3, 4, 5, 6], "digits": 1, "max_new_tokens": 128},
    "real": {"model": REAL_MODEL, "config": "examples/math/smollm2_grpo_cpu.yaml",
             "prompts": 8, "lr": 5e-6, "warmup_steps": 0, "temperature": 0.7, "eval_n": 64,
             "minibatches": 2, "steps": [1], "digits": 1, "max_new_tokens": 64},
}  # fmt: skip


def model_path(setting: str) -> str:
    """The setting's model as a local directory (a hub id from the local cache)."""
    from areal.utils.hf_utils import resolve_model_path

    return resolve_model_path(SETTINGS[setting]["model"])


# ------------------------------------------------------------------------------- data
def make_rows(setting: str, split: str) -> list[dict[str, Any]]:
    """Rows ``{"messages": [...], "answer": ...}`` of the setting's train or test split.

    One ``steps`` value: exactly the rows of ``synthetic://arith?...`` (the demo's data).
    Several: an equal share of each, interleaved so every batch mixes them.
    """
    from areal.dataset.synthetic import ArithSpec, generate_arith_problems

    s = SETTINGS[setting]
    n, seed = (TRAIN_N, TRAIN_SEED) if split == "train" else (s["eval_n"], EVAL_SEED)
    parts = []
    for k in s["steps"]:
        share = -(-n // len(s["steps"]))
        spec = ArithSpec(digits=s["digits"], steps=k, n=share, seed=seed)
        parts.append(generate_arith_problems(spec, split))
    rows = [p[i] for i in range(len(parts[0])) for p in parts if i < len(p)][:n]
    return [
        {"messages": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
        for r in rows
    ]


def _reward(completion: str, answer: str) -> float:
    from areal.reward.gsm8k import gsm8k_reward_fn

    return gsm8k_reward_fn(None, completion, None, None, answer)


# ------------------------------------------------------------------------------ areal
class _CheckpointEvaluator:
    """Replaces the trainer's evaluator: scores the held-out set once the training clock
    passes each checkpoint (rollout paused meanwhile, so no generation runs for free)."""

    def __init__(self, trainer: Any, checkpoints: list[float]):
        self.trainer, self.pending, self.results = trainer, sorted(checkpoints), []

    def evaluate(self, evaluate_fn, epoch, step, global_step):
        t = self.trainer.training_seconds()
        if not self.pending or t < self.pending[0]:
            return None
        while self.pending and t >= self.pending[0]:
            self.pending.pop(0)
        self.trainer.rollout.pause()
        try:
            res = evaluate_fn()
        finally:
            self.trainer.rollout.resume()
        self.results.append(
            {
                "train_seconds": round(t, 1),
                "step": global_step + 1,
                "accuracy": res["eval/accuracy"],
            }
        )
        return res

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def run_areal(setting: str, seconds: float, checkpoints: list[float], extra: list[str]) -> dict:
    from areal import PPOTrainer
    from areal.api.cli_args import GRPOConfig, load_expr_config

    s = SETTINGS[setting]
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as root:
        # constant LR after a 10-step warm-up for the tiny settings, as the demo (which has
        # 100 steps); the real recipe's LR is constant from the start
        warmup = ["actor.optimizer.warmup_steps_proportion=0.001"] if s["warmup_steps"] else []
        cfg, _ = load_expr_config(
            [
                "--config", os.path.join(REPO, s["config"]),
                f"actor.path={s['model']}",
                f"cluster.fileroot={root}",
                f"trial_name=vs-trl-{setting}",
                f"gconfig.max_new_tokens={s['max_new_tokens']}",
                f"eval_gconfig.max_new_tokens={s['max_new_tokens']}",
                f"gconfig.temperature={s['temperature']}",
                f"train_dataset.batch_size={s['prompts']}",
                f"actor.optimizer.lr={s['lr']}",
                f"actor.ppo_n_minibatches={s['minibatches']}",
                "total_train_steps=10000",
                *warmup,
                "recover.mode=disabled",
                "evaluator.freq_steps=1",
                *extra,
            ],
            GRPOConfig,
        )  # fmt: skip
        train, valid = make_rows(setting, "train"), make_rows(setting, "test")
        kwargs = dict(
            reward_fn="areal.reward.gsm8k.gsm8k_reward_fn",
            gconfig=cfg.gconfig,
            tokenizer=cfg.tokenizer_path,
        )
        eval_kwargs = dict(kwargs, gconfig=cfg.eval_gconfig, rollout_stat_scope="eval-rollout")
        with PPOTrainer(cfg, train_dataset=train, valid_dataset=valid) as trainer:
            trainer.evaluator = _CheckpointEvaluator(trainer, checkpoints)
            t_ready = time.monotonic()
            res = trainer.train(
                workflow="areal.workflow.rlvr.RLVRWorkflow",
                workflow_kwargs=kwargs,
                eval_workflow="areal.workflow.rlvr.RLVRWorkflow",
                eval_workflow_kwargs=eval_kwargs,
                max_seconds=seconds,
            )
            rows = [r for r in trainer.stats_logger.history if r["global_step"] >= 0]
            evals = trainer.evaluator.results
    secs = res["train_seconds"]
    n_seqs = sum(r["batch/n_seqs"] for r in rows)
    seq_tok = sum(r["batch/seq_len"] * r["batch/n_seqs"] for r in rows)
    gen_tok = sum(r["batch/gen_len"] * r["batch/n_seqs"] for r in rows)
    # every generated episode (accepted or filtered out): the rollout stats count them
    n_gen = sum(r.get("rollout/completion_len__count", 0.0) for r in rows)
    gen_all_tok = sum(
        r.get("rollout/completion_len", 0.0) * r.get("rollout/completion_len__count", 0.0)
        for r in rows
    )
    phases = ["rollout", "compute_logp", "compute_advantages", "train_step", "update_weights"]
    # mean |trainer - server| logprob on current-version tokens (bf16 vs fp32 shows here)
    gaps = [r["consistency/logp_absdiff_avg"] for r in rows if "consistency/logp_absdiff_avg" in r]
    return {
        "cpu_compute_dtype": cfg.actor.cpu_compute_dtype,
        "logprob_mismatch_mean": round(sum(gaps) / len(gaps), 5) if gaps else None,
        "steps": len(rows),
        "startup_seconds": round(t_ready - t_start, 1),
        "train_seconds": round(secs, 1),
        "trained_samples_per_sec": round(n_seqs / secs, 2),
        "trained_tokens_per_sec": round(seq_tok / secs, 1),
        "trained_completion_tokens_per_sec": round(gen_tok / secs, 1),
        "generated_samples_per_sec": round(n_gen / secs, 2),
        "generated_tokens_per_sec": round(gen_all_tok / secs, 1),
        "seq_len_min_max_in_batch": _spread(rows),
        "step_seconds_by_phase": {
            p: round(sum(r.get(f"time/{p}", 0.0) for r in rows) / max(len(rows), 1), 3)
            for p in phases
        },
        "accuracy_before": res.get("initial_eval", {}).get("eval/accuracy"),
        "checkpoints": evals,
        "accuracy_final": res["final_eval"]["eval/accuracy"],
    }


def _spread(rows: list[dict]) -> list[float] | None:
    lo = [r["batch/seq_len_min"] for r in rows if "batch/seq_len_min" in r]
    hi = [r["batch/seq_len_max"] for r in rows if "batch/seq_len_max" in r]
    if not lo:
        return None
    return [round(sum(lo) / len(lo), 1), round(sum(hi) / len(hi), 1)]


# -------------------------------------------------------------------------------- TRL
def run_trl(setting: str, seconds: float, checkpoints: list[float], workdir: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from areal.utils.hf_utils import load_hf_tokenizer

    s = SETTINGS[setting]
    t_start = time.monotonic()
    path = model_path(setting)
    tok = load_hf_tokenizer(path)
    train = [{"prompt": r["messages"], "answer": r["answer"]} for r in make_rows(setting, "train")]
    valid = make_rows(setting, "test")
    counts = {"gen_samples": 0, "gen_tokens": 0, "prompt_tokens": 0, "seq_min": [], "seq_max": []}
    prompt_len: dict[str, int] = {}

    def reward(prompts, completions, completion_ids, answer, **kw):
        lens = []
        for p, ids in zip(prompts, completion_ids, strict=True):
            key = p[-1]["content"]
            if key not in prompt_len:
                text = tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                prompt_len[key] = len(tok(text, add_special_tokens=False)["input_ids"])
            lens.append(prompt_len[key] + len(ids))
            counts["prompt_tokens"] += prompt_len[key]
            counts["gen_tokens"] += len(ids)
        counts["gen_samples"] += len(completion_ids)
        counts["seq_min"].append(min(lens))
        counts["seq_max"].append(max(lens))
        return [_reward(c[-1]["content"], a) for c, a in zip(completions, answer, strict=True)]

    def evaluate(model) -> float:
        tok.padding_side = "left"
        was_training = model.training
        model.eval()
        correct = 0
        with torch.no_grad():
            for i in range(0, len(valid), 128):
                chunk = valid[i : i + 128]
                texts = [
                    tok.apply_chat_template(
                        r["messages"], tokenize=False, add_generation_prompt=True
                    )
                    for r in chunk
                ]
                enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
                out = model.generate(
                    **enc,
                    max_new_tokens=s["max_new_tokens"],
                    do_sample=False,
                    pad_token_id=tok.pad_token_id,
                )
                for r, ids in zip(chunk, out[:, enc["input_ids"].shape[1] :], strict=True):
                    text = tok.decode(ids, skip_special_tokens=True)
                    correct += _reward(text, r["answer"]) > 0
        if was_training:
            model.train()
        return correct / len(valid)

    class Clock(TrainerCallback):
        def __init__(self):
            self.t0 = None
            self.paused = 0.0
            self.pending = sorted(checkpoints)
            self.results: list[dict] = []
            self.steps = 0

        def elapsed(self) -> float:
            return 0.0 if self.t0 is None else time.monotonic() - self.t0 - self.paused

        def on_step_begin(self, args, state, control, **kw):
            if self.t0 is None:
                self.t0 = time.monotonic()

        def on_step_end(self, args, state, control, model=None, **kw):
            self.steps += 1
            t = self.elapsed()
            if self.pending and t >= self.pending[0]:
                while self.pending and t >= self.pending[0]:
                    self.pending.pop(0)
                te = time.monotonic()
                acc = evaluate(model)
                self.paused += time.monotonic() - te
                self.results.append(
                    {"train_seconds": round(t, 1), "step": self.steps, "accuracy": acc}
                )
            if t >= seconds:
                control.should_training_stop = True
            return control

    args = GRPOConfig(
        output_dir=workdir,
        learning_rate=s["lr"],
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=s["warmup_steps"],
        # one generation batch of prompts x GROUP samples, trained in ``minibatches``
        # optimizer steps (areal's ppo_n_minibatches)
        per_device_train_batch_size=s["prompts"] * GROUP // s["minibatches"],
        steps_per_generation=s["minibatches"],
        gradient_accumulation_steps=1,
        num_generations=GROUP,
        max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"],
        beta=0.0,
        epsilon=0.2,
        max_steps=10000,
        gradient_checkpointing=False,
        num_train_epochs=1,
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        logging_steps=10**9,
        save_strategy="no",
        seed=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    before = evaluate(model)
    clock = Clock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(train),
        processing_class=tok,
        callbacks=[clock],
    )
    startup = time.monotonic() - t_start
    with contextlib.redirect_stdout(sys.stderr):  # TRL prints its metrics dicts
        trainer.train()
    secs = clock.elapsed()
    if not clock.results or clock.results[-1]["step"] != clock.steps:
        clock.results.append(
            {"train_seconds": round(secs, 1), "step": clock.steps, "accuracy": evaluate(model)}
        )
    n = counts["gen_samples"]
    tokens = counts["gen_tokens"] + counts["prompt_tokens"]
    mins, maxs = counts["seq_min"], counts["seq_max"]
    return {
        "steps": clock.steps,
        "startup_seconds": round(startup, 1),
        "train_seconds": round(secs, 1),
        "trained_samples_per_sec": round(n / secs, 2),
        "trained_tokens_per_sec": round(tokens / secs, 1),
        "trained_completion_tokens_per_sec": round(counts["gen_tokens"] / secs, 1),
        "generated_samples_per_sec": round(n / secs, 2),
        "generated_tokens_per_sec": round(counts["gen_tokens"] / secs, 1),
        "seq_len_min_max_in_batch": (
            [round(sum(mins) / len(mins), 1), round(sum(maxs) / len(maxs), 1)] if mins else None
        ),
        "step_seconds": round(secs / max(clock.steps, 1), 3),
        "accuracy_before": before,
        "checkpoints": clock.results,
        "accuracy_final": clock.results[-1]["accuracy"],
    }


def probe_trl_threads(setting: str) -> tuple[int, dict[str, float]]:
    """TRL's fastest torch thread count here: one sampled generation of a batch plus one
    forward/backward, timed at 1 and at all cores (many threads on a busy 2-core machine
    can be 10x slower than one; the baseline gets its best setting)."""
    import torch
    from transformers import AutoModelForCausalLM

    from areal.utils.hf_utils import load_hf_tokenizer

    path = model_path(setting)
    tok = load_hf_tokenizer(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows = make_rows(setting, "train")[: SETTINGS[setting]["prompts"] * GROUP]
    texts = [
        tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
        for r in rows
    ]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    times: dict[str, float] = {}
    for n in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(n)
        best = math.inf
        for _ in range(2):
            t0 = time.monotonic()
            with torch.no_grad():
                out = model.generate(
                    **enc, max_new_tokens=SETTINGS[setting]["max_new_tokens"], do_sample=True,
                    pad_token_id=tok.pad_token_id,
                )  # fmt: skip
            model(input_ids=out).logits.float().logsumexp(-1).mean().backward()
            best = min(best, time.monotonic() - t0)
        times[str(n)] = round(best, 3)
    torch.set_num_threads(1)
    return int(min(times, key=times.get)), times


# ------------------------------------------------------------------------------- main
def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or (isinstance(b, float) and math.isnan(b)):
        return None
    return round(a / b, 3)


def compare(ours: dict, trl: dict, checkpoints: list[float], eval_n: int) -> dict:
    keys = [
        "trained_samples_per_sec",
        "trained_tokens_per_sec",
        "generated_samples_per_sec",
        "generated_tokens_per_sec",
    ]
    out: dict[str, Any] = {k: _ratio(ours[k], trl[k]) for k in keys}
    acc = []
    for c in checkpoints:
        a = next((e for e in ours["checkpoints"] if e["train_seconds"] >= c), None)
        b = next((e for e in trl["checkpoints"] if e["train_seconds"] >= c), None)
        if a and b:
            pa, pb = a["accuracy"], b["accuracy"]
            acc.append(
                {"checkpoint": c, "areal": pa, "trl": pb, "delta": round(pa - pb, 4),
                 # the delta's standard error as binomial sampling of the held-out problems
                 "delta_standard_error": round(
                     math.sqrt((pa * (1 - pa) + pb * (1 - pb)) / eval_n), 4)}
            )  # fmt: skip
    out["accuracy_at_checkpoints"] = acc
    late = {"areal": _late_accuracy(ours, checkpoints), "trl": _late_accuracy(trl, checkpoints)}
    if late["areal"] and late["trl"]:
        late["delta_of_means"] = round(late["areal"]["mean"] - late["trl"]["mean"], 4)
        out["accuracy_second_half"] = late
    return out


def _late_accuracy(run: dict, checkpoints: list[float]) -> dict | None:
    """Held-out accuracy over the second half of the run (evaluations at or after half the
    last checkpoint): mean, standard deviation, and the standard deviation of the change
    between consecutive evaluations (how much one greedy evaluation of the policy moves
    from one checkpoint to the next once training has levelled off). Needs dense
    ``--checkpoints`` (at least 3 in the second half) to mean anything."""
    half = max(checkpoints) / 2
    accs = [e["accuracy"] for e in run["checkpoints"] if e["train_seconds"] >= half]
    if len(accs) < 3:
        return None
    steps = [b - a for a, b in zip(accs, accs[1:])]
    return {
        "n": len(accs),
        "mean": round(statistics.fmean(accs), 4),
        "stdev": round(statistics.stdev(accs), 4),
        "stdev_of_consecutive_changes": round(statistics.pstdev(steps), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--setting",
        choices=["demo", "longtail", "both", "real"],
        default="both",
        help="'both' = demo + longtail (the tiny model); 'real' = the real-model recipe "
        "(SmolLM2-135M-Instruct, `make real-model`; e.g. --seconds 1200 "
        "--checkpoints 300,600,1200 --dynamic-sampling off)",
    )
    ap.add_argument("--seconds", type=float, default=300.0, help="training wall time per side")
    ap.add_argument(
        "--checkpoints",
        type=str,
        default="60,150,300",
        help="comma-separated training times (s) at which held-out accuracy is taken; "
        "those above --seconds are dropped (the end of the run is always scored)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="TRL's torch threads (0: the faster of 1 and all cores, probed per setting)",
    )
    ap.add_argument(
        "--dynamic-sampling",
        choices=["on", "off", "both"],
        default="on",
        help="areal's dynamic sampling (the demo's default: on, groups whose samples all "
        "got the same reward are dropped; off: every group is trained, as TRL does); "
        "'both' runs areal twice per setting against the same TRL run "
        "(`areal` and `areal_no_dynamic_sampling` in the JSON)",
    )
    ap.add_argument(
        "--trl-runs",
        choices=["after", "around"],
        default="after",
        help="'after': one TRL run after areal's; 'around': TRL runs before AND after "
        "areal's and areal is compared with the FASTER of the two (trained samples/s; "
        "its accuracies too), both runs reported (`trl_runs`): on a shared machine "
        "TRL's rate moves with the load, and the faster baseline is the conservative one",
    )
    ap.add_argument("--skip-trl", action="store_true", help="run areal's side only (dev)")
    ap.add_argument("--skip-areal", action="store_true", help="run TRL's side only (dev)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of areal's side")
    args = ap.parse_args()

    import torch

    from areal.utils.cpu_info import cpu_kind, describe

    checkpoints = [float(x) for x in args.checkpoints.split(",") if x.strip()]
    checkpoints = [c for c in checkpoints if c <= args.seconds] or [args.seconds]
    settings = ["demo", "longtail"] if args.setting == "both" else [args.setting]
    result: dict[str, Any] = {
        "benchmark": "areal_vs_trl",
        "group": GROUP,
        "seconds": args.seconds,
        "cpu_count": os.cpu_count(),
        "cpu": cpu_kind(),  # a ratio measured on one CPU kind does not carry to another
        "areal_overrides": args.overrides,
        "load_average_before": os.getloadavg(),
    }
    print(f"CPU: {describe(result['cpu'])}", file=sys.stderr, flush=True)
    for setting in settings:
        entry: dict[str, Any] = {
            k: SETTINGS[setting][k]
            for k in ("model", "prompts", "lr", "temperature", "max_new_tokens", "eval_n")
        }
        entry["model"] = os.path.relpath(entry["model"], REPO) if os.path.isabs(
            entry["model"]) else entry["model"]  # fmt: skip
        trl_runs: list[dict[str, Any]] = []

        def trl_run(position: str, entry=entry, setting=setting, trl_runs=trl_runs) -> None:
            if "trl_threads" not in entry:
                threads = args.threads
                if not threads:
                    threads, entry["trl_thread_probe_seconds"] = probe_trl_threads(setting)
                entry["trl_threads"] = threads
            torch.set_num_threads(entry["trl_threads"])
            with tempfile.TemporaryDirectory() as wd:
                run = run_trl(setting, args.seconds, checkpoints, wd)
            torch.set_num_threads(1)
            run["position"] = position
            run["load_average_after"] = os.getloadavg()
            trl_runs.append(run)

        if not args.skip_trl and args.trl_runs == "around":
            trl_run("before_areal")
        if not args.skip_areal:
            for ds in ("on", "off"):
                if args.dynamic_sampling not in (ds, "both"):
                    continue
                key = "areal" if ds == "on" or args.dynamic_sampling == "off" else (
                    "areal_no_dynamic_sampling"
                )  # fmt: skip
                over = [*args.overrides, f"actor.dynamic_sampling={ds == 'on'}"]
                entry[key] = run_areal(setting, args.seconds, checkpoints, over)
                entry[key]["dynamic_sampling"] = ds == "on"
                entry[f"load_average_after_{key}"] = os.getloadavg()
        if not args.skip_trl:
            trl_run("after_areal")
            # the baseline areal is compared with: the faster TRL run
            entry["trl"] = max(trl_runs, key=lambda r: r["trained_samples_per_sec"])
            entry["load_average_after_trl"] = trl_runs[-1]["load_average_after"]
            if len(trl_runs) > 1:
                entry["trl_runs"] = trl_runs
        if "areal" in entry and "trl" in entry:
            entry["ratios_areal_over_trl"] = compare(
                entry["areal"], entry["trl"], checkpoints, entry["eval_n"]
            )
        if "areal_no_dynamic_sampling" in entry and "trl" in entry:
            entry["ratios_areal_no_dynamic_sampling_over_trl"] = compare(
                entry["areal_no_dynamic_sampling"], entry["trl"], checkpoints, entry["eval_n"]
            )
        for key in ("areal", "areal_no_dynamic_sampling"):
            if key in entry and len(trl_runs) > 1:  # accuracy against each TRL run
                entry[f"accuracy_{key}_vs_each_trl_run"] = {
                    r["position"]: compare(entry[key], r, checkpoints, entry["eval_n"])[
                        "accuracy_at_checkpoints"
                    ]
                    for r in trl_runs
                }
        result[setting] = entry
        print(json.dumps({setting: entry}), file=sys.stderr, flush=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
