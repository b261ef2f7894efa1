"""The pipeline-parallel (``p`` > 1) paths of ``ArchonEngine``.

Build: the model is cut into stages (``areal.models.archon.pipeline.plan_stages``, from
``archon.pp_schedule``, ``pp_layers_per_stage``, ``pp_first_stage_less_layers``,
``pp_last_stage_less_layers``); this rank keeps the stage(s) ``s`` with
``s % pp == pp_rank`` and the family's parallelize function (tp, activation
checkpointing, FSDP2 on ``dp_shard``) is applied to each stage as its own FSDP root.
:class:`PipelineParts` holds the kept modules under the full model's names, so DCP
checkpoints, the optimizer state and the exported HF names are the same as at ``p1``
(a checkpoint saved at ``p2`` loads at ``d2``).

Train: the packed micro-batches are padded to one length (an extra padding sequence
at the end of each) and, when fewer than a multiple of ``pp``, completed with
zero-weight padding micro-batches; a fresh ``torch.distributed.pipelining`` schedule
runs them with ``scale_grads=False``; the loss of micro-batch ``i`` is computed on the
last stage and scaled as ``FSDPEngine.train_batch`` scales it (``weight_i / total x
dp``). The reported loss is summed over the ``pp`` group, the gradient norm for clipping
over ``pp`` too. Forward-only passes (``forward_batch``, ``eval_batch``) send the
activations stage to stage and broadcast the last stage's per-token output to every
pipeline rank.

Mixture-of-experts models: the stages are ``MoEStage``s (routing replay of their own
layers; with ``output_router_logits`` the load-balancing loss's sums travel with the
activations and the last stage adds ``router_aux_loss_coef`` x the loss of the whole
model to each micro-batch's loss). Context parallelism (``c`` > 1): the padded length is
a multiple of ``cp``, each cp rank runs its consecutive part of every micro-batch
through its stages (stage ``s``'s cp rank ``r`` sends to stage ``s + 1``'s cp rank
``r``) and the last stage gathers the per-token logprobs over ``cp`` before the loss.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from areal.api.io_struct import ParamSpec
from areal.engine.fsdp.checkpoint import write_safetensors
from areal.engine.fsdp.weight_export import bucket_param_specs
from areal.models.archon.pipeline import DenseStage, build_schedule, make_stage, plan_stages
from areal.models.archon.ulysses import gather_seq
from areal.utils import logging
from areal.utils.dist import broadcast_tensor

__all__ = ["ArchonPipelineMixin", "PipelineParts"]

logger = logging.getLogger("ArchonEngine")


class PipelineParts(nn.Module):
    """This rank's stages' modules under the full model's names (``tok_embeddings``,
    ``layers.<i>``, ``norm``, ``output``); the stages themselves (FSDP roots) are kept
    unregistered in ``stages``."""

    def __init__(self, stages: list[DenseStage]):
        super().__init__()
        layers: dict[str, nn.Module] = {}
        for st in stages:
            if st.tok_embeddings is not None:
                self.tok_embeddings = st.tok_embeddings
            layers.update(st.layers.items())
            if st.is_last:
                self.norm, self.output = st.norm, st.output
        self.layers = nn.ModuleDict({k: layers[k] for k in sorted(layers, key=int)})
        object.__setattr__(self, "stages", list(stages))

    def train(self, mode: bool = True) -> PipelineParts:
        super().train(mode)
        for st in self.stages:
            st.train(mode)
        return self

    def forward(self, *args, **kwargs):
        raise RuntimeError("PipelineParts is run stage by stage (ArchonPipelineMixin)")


class ArchonPipelineMixin:
    """``ArchonEngine``'s methods for ``pp`` > 1 (module docstring)."""

    _pp_stages: list[DenseStage] | None = None
    _pp_n_stages: int = 1
    _aux_coef: float = 0.0  # ArchonEngine: the load-balancing loss's coefficient

    # ------------------------------------------------------------------ build
    def _build_pipeline(self, model: nn.Module, spec, dims, args, **parallel_kw) -> nn.Module:
        ac = self.config.archon
        ranges = plan_stages(
            args.n_layers,
            dims.pp,
            ac.pp_schedule,
            ac.pp_layers_per_stage,
            ac.pp_first_stage_less_layers,
            ac.pp_last_stage_less_layers,
        )
        self._pp_n_stages = n = len(ranges)
        rank = dims.get_mesh("pp").get_local_rank()
        stages = [make_stage(model, s, n, ranges[s]) for s in range(rank, n, dims.pp)]
        for st in stages:
            spec.parallelize_fn(st, dims, **parallel_kw)
        self._pp_stages = stages
        parts = PipelineParts(stages)
        self._pp_gather_specs(parts)
        return parts

    # ------------------------------------------------------------------ xccl push
    def _pp_gather_specs(self, parts: PipelineParts) -> None:
        """Every pipeline rank's export specs (HF names, full shapes, export dtype), in
        pp-rank order, on every rank: ``get_param_specs`` is asked of rank 0 alone."""
        named = {
            k.replace("_checkpoint_wrapped_module.", ""): v for k, v in parts.named_parameters()
        }
        mine = self._export_specs(self.state_dict_adapter.to_hf(named))
        group = self._pp_group()
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, [sp.to_dict() for sp in mine], group=group)
        self._pp_specs = [[ParamSpec.from_dict(d) for d in specs] for specs in out]

    def get_param_specs(self, weight_chunked_mem_mb: int = 1024):
        """At ``pp`` > 1: pipeline rank 0's buckets, then rank 1's, ... (a bucket never
        spans two ranks' tensors): the order ``update_weights`` broadcasts them in."""
        if self._pp_stages is None:
            return super().get_param_specs(weight_chunked_mem_mb)
        if weight_chunked_mem_mb <= 0:
            raise ValueError(f"weight_chunked_mem_mb={weight_chunked_mem_mb}; must be > 0")
        limit = int(weight_chunked_mem_mb) << 20
        return [b for specs in self._pp_specs for b in bucket_param_specs(specs, limit)]

    def _update_weights_from_distributed(self, meta) -> None:
        """xccl at ``pp`` > 1: each stage gathers its own tensors bucket by bucket (each
        tensor once, over the stage's data/tensor ranks); rank 0 broadcasts its stage's
        buckets to the servers, then receives every other stage's buckets from that
        stage's first rank (point to point, one bucket at a time) and broadcasts them.
        No rank holds more than its stage and one bucket."""
        if self._pp_stages is None:
            return super()._update_weights_from_distributed(meta)
        t0 = time.perf_counter()
        rank, pp = dist.get_rank(), self._dims().pp
        inner = dist.get_world_size() // pp  # ranks of one stage (pp is the outer dim)
        if rank == 0:
            self._ensure_weight_update_group(meta)
        limit = int(meta.weight_chunked_mem_mb) << 20
        digests = self._pp_push_digests()

        def push(bucket, tensors):
            if digests is not None:
                digests.add(list(zip((sp.name for sp in bucket), tensors)))
            fut = None
            if self.inference_engine is not None:
                fut = self.inference_engine.update_weights_from_distributed(meta, bucket)
            for t in tensors:
                broadcast_tensor(self._weight_update_group, t, root=0)
            if fut is not None:
                try:
                    fut.result()
                except Exception as e:  # re-raised with context
                    raise RuntimeError(
                        f"inference_engine.update_weights_from_distributed failed: {e}"
                    ) from e

        for bucket, tensors in self._gather_buckets(limit):
            if rank == 0:
                push(bucket, tensors)
            elif rank % inner == 0:  # a later stage's first rank: to rank 0
                for t in tensors:
                    dist.send(t, dst=0)
            del tensors
        if rank == 0:
            for p in range(1, pp):
                for bucket in bucket_param_specs(self._pp_specs[p], limit):
                    tensors = [
                        torch.empty(sp.shape, dtype=getattr(torch, sp.dtype), device=self.device)
                        for sp in bucket
                    ]
                    for t in tensors:
                        dist.recv(t, src=p * inner)
                    push(bucket, tensors)
                    del tensors
        if digests is not None:  # every stage's tensors went through rank 0's push
            digests.complete = True
        self._export_digests = digests
        dist.barrier()
        logger.info("xccl weight update (p%d) done in %.2fs", pp, time.perf_counter() - t0)

    # ------------------------------------------------------------------ verified sync
    def _gather_buckets(self, limit_bytes: int, digest_pool: Any = None, defer: bool = False):
        """At ``pp`` > 1 a stage's export holds only its own tensors: no digests are taken
        here (they would cover one stage); ``weights_fingerprint`` then asks every stage,
        and the xccl push digests on rank 0, which sees every tensor."""
        if getattr(self, "_pp_stages", None) is None:
            yield from super()._gather_buckets(limit_bytes, digest_pool, defer)
            return
        every, self._fingerprint_every = getattr(self, "_fingerprint_every", 0), 0
        try:
            yield from super()._gather_buckets(limit_bytes)
        finally:
            self._fingerprint_every = every
            self._export_digests = None

    def _pp_push_digests(self) -> Any:
        """Rank 0, at the start of an xccl push with verified weight sync: digests of the
        whole model (every stage's names and sizes for the rotation share), fed with each
        bucket as it is broadcast. None when verification is off."""
        from areal.infra.weights.fingerprint import WeightDigests, rotation_share

        every = getattr(self, "_fingerprint_every", 0)
        if not every:
            return None
        sizes = [(sp.name, math.prod(sp.shape)) for specs in self._pp_specs for sp in specs]
        share = rotation_share(sizes, every, self._fingerprint_checks)
        return WeightDigests(dist.get_rank() == 0, share, self._fingerprint_dtypes, None)

    def weights_fingerprint(
        self, seed: int = 0, dtypes: dict[str, str] | None = None, full: list[str] | None = None
    ) -> dict[str, list[float]]:
        """At ``pp`` > 1: the xccl push's digests on rank 0 when they are at hand (every
        stage's tensors went through rank 0); otherwise collective: each stage fingerprints
        its own tensors and the pipeline ranks exchange them (same result on every rank)."""
        cached = getattr(self, "_export_digests", None)
        usable = cached is not None and cached.complete and dtypes is None and full is None
        if self._pp_stages is None or usable:
            return super().weights_fingerprint(seed, dtypes, full)
        mine = super().weights_fingerprint(seed, dtypes, full)
        parts: list[Any] = [None] * dist.get_world_size(self._pp_group())
        dist.all_gather_object(parts, mine, group=self._pp_group())
        return {k: v for part in parts for k, v in part.items()}

    # ------------------------------------------------------------------ helpers
    def _pp_group(self) -> dist.ProcessGroup:
        return self._dims().get_group("pp")

    def _pp_global(self, stage: int) -> int:
        """The global rank holding ``stage`` in this rank's pipeline."""
        return dist.get_global_rank(self._pp_group(), stage % self._dims().pp)

    def _pp_stage(self, s: int) -> DenseStage:
        return self._pp_stages[s // self._dims().pp]

    def _pp_owns(self, s: int) -> bool:
        return s % self._dims().pp == self._dims().get_mesh("pp").get_local_rank()

    def _pp_out_dim(self) -> int:
        return 1 if self.is_critic else int(self.model_config.vocab_size)

    def _pp_cp_slice(self, length: int) -> slice:
        """This context-parallel rank's consecutive part of a ``length``-token stream."""
        dims = self._dims()
        part = length // dims.cp
        r = dims.get_mesh("cp").get_local_rank()
        return slice(r * part, (r + 1) * part)

    def _pp_head(self, out: torch.Tensor, mb: dict[str, Any], labels: torch.Tensor):
        """Last stage's ``[rows, out_dim]`` (this cp rank's rows of the padded stream,
        ``labels`` their next tokens) -> (logprobs, entropy) or (values, None) of the
        micro-batch's ``n`` tokens, as ``ArchonEngine._forward_packed`` (row ``i`` scores
        token ``i``; gathered over ``cp``, differentiably)."""
        dims = self._dims()
        group = dims.get_group("cp") if dims.cp > 1 else None
        ids, cu = mb["input_ids"], mb["cu_seqlens"].long()
        n = ids.shape[0]
        if self.is_critic:
            vals = out[:, 0].float()
            return (vals if group is None else gather_seq(vals, group))[:n], None
        logp = torch.log_softmax(out.float() / self.temperature, dim=-1)
        lp = logp.gather(-1, labels[:, None])[:, 0]
        with torch.no_grad():
            ent = -(logp.exp() * logp).sum(-1)
        if group is not None:
            lp, ent = gather_seq(lp, group), gather_seq(ent, group)
        pred = torch.roll(torch.stack([lp[:n], ent[:n]], dim=-1), shifts=1, dims=0)
        is_first = torch.zeros(n, dtype=torch.bool, device=ids.device)
        is_first[cu[:-1]] = True
        pred = torch.where(is_first[:, None], torch.zeros_like(pred), pred)
        return pred[:, 0], pred[:, 1].detach()

    def _pp_pad_meta(self, mb: dict[str, Any] | None, length: int):
        """(tokens [length], labels [length], (positions, cu_seqlens, n_real, routed)) of a
        micro-batch padded to ``length`` (the padding is a sequence of its own; None: a
        padding micro-batch), positions, labels and routing cut to this cp rank's part."""
        dev, sl = self.device, self._pp_cp_slice(length)
        tokens = torch.zeros(length, dtype=torch.long, device=dev)
        labels = torch.zeros_like(tokens)
        routed = self._routed_experts(mb) if mb is not None else None
        if mb is None:
            pos = torch.arange(length, device=dev)
            cu = torch.tensor([0, length], dtype=torch.int32, device=dev)
            k = 0
        else:
            ids, pos, cu = mb["input_ids"], mb["position_ids"], mb["cu_seqlens"].int()
            k = ids.shape[0]
            tokens[:k], labels[:k] = ids, torch.roll(ids, shifts=-1)
            if k < length:
                pos = torch.cat([pos, torch.arange(length - k, device=dev, dtype=pos.dtype)])
                cu = F.pad(cu, (0, 1), value=length)
        if routed is not None and k < length:  # padding tokens: experts 0..top_k-1
            fill = torch.arange(routed.shape[-1], device=dev).expand(
                length - k, routed.shape[1], -1
            )
            routed = torch.cat([routed, fill.to(routed.dtype)])
        n_real = max(0, min(sl.stop, k) - sl.start) if mb is not None else sl.stop - sl.start
        routed = routed[sl] if routed is not None else None
        return tokens, labels[sl], (pos[sl], cu, n_real, routed)

    # ------------------------------------------------------------------ forward only
    def _pp_forward_packed(self, mb: dict[str, Any]):
        """One packed micro-batch through every stage in order (no schedule: forward
        only); the result is broadcast from the last stage to the whole ``pp`` group."""
        n, last = mb["input_ids"].shape[0], self._pp_n_stages - 1
        length = -(-n // self._dims().cp) * self._dims().cp
        tokens, labels, meta = self._pp_pad_meta(mb, length)
        rows = labels.shape[0]
        group = self._pp_group()
        h = None
        for s in range(self._pp_n_stages):
            if not self._pp_owns(s):
                continue
            if s == 0:
                x = tokens[self._pp_cp_slice(length)][None]
            elif self._pp_owns(s - 1):
                x = h
            else:
                x = torch.empty(1, rows, self.model_config.hidden_size, dtype=self.dtype)
                x = x.to(self.device)
                dist.recv(x, src=self._pp_global(s - 1), group=group)
            st = self._pp_stage(s)
            st.set_micro_batches([meta])
            h = st(x)
            st.set_micro_batches(None)
            if s < last and not self._pp_owns(s + 1):
                dist.send(h.contiguous(), dst=self._pp_global(s + 1), group=group)
        width = 1 if self.is_critic else 2
        res = torch.empty(n, width, dtype=torch.float32, device=self.device)
        if self._pp_owns(last):
            a, b = self._pp_head(h[0], mb, labels)
            res = a[:, None] if b is None else torch.stack([a, b], dim=-1)
            res = res.contiguous()
        dist.broadcast(res, src=self._pp_global(last), group=group)
        return (res[:, 0], None) if self.is_critic else (res[:, 0], res[:, 1])

    # ------------------------------------------------------------------ train
    def _pp_train_batch(
        self, input_: dict[str, Any], loss_fn: Callable[..., torch.Tensor], loss_weight_fn
    ) -> dict[str, float]:
        """One step through a pipeline schedule (module docstring); a mixture-of-experts
        model whose HF config sets ``output_router_logits`` adds ``router_aux_loss_coef``
        x the micro-batch's load-balancing loss (every stage's MoE layers: the sums
        travel with the activations, :class:`~areal.models.archon.pipeline.MoEStage`)."""
        model = self._require_model()
        if self.optimizer is None:
            raise RuntimeError("train_batch needs config.optimizer (this engine has none)")
        model.train()
        mbs = [self._to_device(mb) for mb in self._split(input_).packed()]
        weights, total = self._mb_weights(mbs, loss_weight_fn)
        dims, dp = self._dims(), self.data_parallel_world_size
        n_real = len(mbs)
        n_mb = -(-n_real // dims.pp) * dims.pp  # a multiple of pp (padding micro-batches)
        length = max(int(mb["input_ids"].shape[0]) for mb in mbs)
        length = -(-length // dims.cp) * dims.cp  # each cp rank an equal part
        padded = [self._pp_pad_meta(mbs[i] if i < n_real else None, length) for i in range(n_mb)]
        tokens = torch.stack([t for t, _, _ in padded])[:, self._pp_cp_slice(length)]
        coef = self._aux_coef
        for st in self._pp_stages:
            st.set_micro_batches([m for *_, m in padded])
            if hasattr(st, "carry_aux"):
                st.carry_aux = coef > 0
        n_st = self._pp_n_stages
        last = self._pp_stage(n_st - 1) if self._pp_owns(n_st - 1) else None
        acc = [torch.zeros((), dtype=torch.float64, device=self._reduce_device())]

        def pp_loss(out: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
            i = int(idx.reshape(-1)[0])
            aux = last.pop_aux(i) if coef > 0 else None
            if i >= n_real:  # a padding micro-batch: no loss, no gradient
                return (out.sum() + (0.0 if aux is None else aux)) * 0.0
            mb = mbs[i]
            o, e = self._pp_head(out[0], mb, padded[i][1])
            loss = loss_fn(o, e, mb)
            if not torch.is_tensor(loss) or loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar tensor, got {loss!r:.80}")
            if aux is not None:
                loss = loss + coef * aux
            w = float(weights[i] / total)
            acc[0] = acc[0] + loss.detach().double() * w
            return loss * (w * dp)

        schedule = self.config.archon.pp_schedule
        stages = self._pp_stages if schedule == "Interleaved1F1B" else self._pp_stages[0]
        sched = build_schedule(
            stages,
            self._pp_group(),
            n_mb,
            pp_loss,
            schedule,
            scale_grads=False,
            shapes=(length // dims.cp, self._pp_out_dim()),
            act_dtype=self.dtype,
        )
        self.optimizer_zero_grad()
        target = torch.arange(n_mb, device=self.device).reshape(n_mb, 1)
        try:
            sched.step(tokens, target=target)
        finally:
            for st in self._pp_stages:
                st.set_micro_batches(None)
                if hasattr(st, "carry_aux"):
                    st.carry_aux = False
        stats = self.optimizer_step()
        loss_t = acc[0].reshape(1)
        dist.all_reduce(loss_t, group=self._pp_group())
        stats["loss"] = float(self._all_reduce_sum(loss_t)[0])
        return stats

    # ------------------------------------------------------------------ export
    def _pp_save_hf(self, path: str, tokenizer: Any = None) -> None:
        """HF save at ``pp`` > 1: each stage's tensors are gathered over its data/tensor
        ranks and written by the stage's first rank as ``model-0000{s+1}-of-0000{pp}``;
        rank 0 writes the index and the config."""
        import json

        dims = self._dims()
        pp, s = dims.pp, dims.get_mesh("pp").get_local_rank()
        inner = dist.get_world_size() // pp  # ranks of one stage (pp is the outer dim)
        head = dist.get_rank() % inner == 0
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
            for f in os.listdir(path):
                if f.endswith(".safetensors") or f in (
                    "model.safetensors.index.json",
                    "weights_fingerprint.json",  # weight_fingerprint.REFERENCE_FILE
                ):
                    os.remove(os.path.join(path, f))
        dist.barrier()
        named: dict[str, torch.Tensor] = {}
        for specs, tensors in self._gather_buckets(1 << 62):
            named.update({sp.name: t for sp, t in zip(specs, tensors, strict=True)})
        fname = f"model-{s + 1:05d}-of-{pp:05d}.safetensors"
        if head:
            write_safetensors(named, os.path.join(path, fname), {"format": "pt"})
        entry = (fname, sorted(named), sum(t.numel() * t.element_size() for t in named.values()))
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, entry if head else None)
        if dist.get_rank() == 0:
            parts = [g for g in gathered if g is not None]
            index = {
                "metadata": {"total_size": sum(b for *_, b in parts)},
                "weight_map": {k: f for f, names, _ in parts for k in names},
            }
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=1, sort_keys=True)
            cfg = self.model_config
            cfg.use_cache = True
            cfg.save_pretrained(path)
            cfg.use_cache = False
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
        dist.barrier()

    def _pp_export_weight_shards(self, path: str, shard_mb: float = 128) -> int:
        """``export_weight_shards`` at ``pp`` > 1: each stage exports its own tensors;
        bucket ``i`` of stage ``s`` is written by the stage's rank ``i % ranks_per_stage``
        as ``model-pp{s}-rank{r}-{i:05d}.safetensors`` (disjoint files, every tensor once)."""
        dims = self._dims()
        rank, world = dist.get_rank(), dist.get_world_size()
        inner = world // dims.pp
        s = dims.get_mesh("pp").get_local_rank()
        if rank == 0:
            os.makedirs(path, exist_ok=True)
            for f in os.listdir(path):
                if f.endswith(".safetensors"):
                    os.remove(os.path.join(path, f))
        dist.barrier()
        written = 0
        limit = max(1, int(float(shard_mb) * (1 << 20)))
        for i, (specs, tensors) in enumerate(self._gather_buckets(limit)):
            if i % inner != rank % inner:
                continue
            named = {sp.name: t for sp, t in zip(specs, tensors, strict=True)}
            out = os.path.join(path, f"model-pp{s}-rank{rank}-{i:05d}.safetensors")
            write_safetensors(named, out)
            written += sum(t.numel() * t.element_size() for t in tensors)
        if rank == 0:
            cfg = self.model_config
            cfg.use_cache = True
            cfg.save_pretrained(path)
            cfg.use_cache = False
        dist.barrier()
        return written
