"""Hugging Face references for server tests: the model, greedy continuations, logprobs.

The built-in server must reproduce these exactly (tokens) or to 1e-4 (logprobs).
"""

from __future__ import annotations

import torch

EOS = 2  # the tiny models' end-of-sequence id


def hf_model(model_dir):
    """The checkpoint as an fp32 ``AutoModelForCausalLM`` in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    """HF ``generate`` greedy continuation of ``prompt`` (stops at EOS)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0):
    """``log_softmax(logits / temperature)`` of each ``output`` token after ``prompt``."""
    logits = model(torch.tensor([prompt + output])).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    return lp.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)
