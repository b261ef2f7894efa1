"""``ArchonEngine``: the PyTorch-native parallel training engine (AReaL's Archon):
FSDP2 on ``dp_shard``, tensor parallel with DTensor, context parallel as Ulysses, on
the model families of ``areal.models.archon``.

Selected with ``backend='archon:d2t2'`` (or ``allocation_mode='...+archon:d2t2'``, which
the trainers copy into the role's ``backend``). ``initialize`` does, in order:

1. the process group (``RANK``/``WORLD_SIZE``/``MASTER_*``; gloo on CPU, NCCL on CUDA);
2. the layout from ``config.backend`` (``d`` dp_shard, ``t`` tp, ``c`` cp, ``e`` ep
   within dp_shard, ``p`` pipeline stages; the MoE hybrid form ``(attn:d2t2|ffn:d2e2)``:
   ep over the cp and tp ranks) and the ``ArchonParallelDims`` mesh (device type of
   this engine's device);
3. the family from the HF ``model_type`` (registry), its args from the HF config,
   ``check_layout`` (heads divisible by tp, ...) and ``config.archon`` refusals;
4. the model built on every rank from the same seed, the HF weights loaded through the
   family's state-dict adapter;
5. the family's parallelize function (tp, cp, ep for MoE, activation checkpointing, FSDP2);
   at ``p`` > 1 the model is first cut into pipeline stages and each stage is
   parallelized on its own (``areal.engine.archon.pipeline_engine``);
6. optimizer and LR schedule (as ``FSDPEngine``).

Training, evaluation, forward, checkpoints and weight export are ``FSDPEngine``'s code
(same ``TrainEngine`` interface, same loss contract); this class replaces what depends
on the model: the packed forward (cp split and gather, logprobs from the logits), the
data-parallel groups (``dp_shard``; tp and cp ranks of one dp rank get the same batch),
the gradient norm over mixed meshes, and the HF names of exported tensors.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from areal.api.alloc_mode import ParallelStrategy
from areal.api.io_struct import SaveLoadMeta
from areal.engine.archon.grad_norm import clip_grad_norm_
from areal.engine.archon.pipeline_engine import ArchonPipelineMixin
from areal.engine.fsdp.checkpoint import write_safetensors
from areal.engine.fsdp.engine import FSDPEngine
from areal.engine.fsdp.weight_export import DTYPES
from areal.models.archon import ArchonParallelDims, check_layout, get_model_spec
from areal.models.archon.ulysses import gather_seq
from areal.utils import logging

logger = logging.getLogger("ArchonEngine")

__all__ = ["ArchonEngine", "archon_layout"]


def archon_layout(config: Any, world_size: int) -> ParallelStrategy:
    """The parallel sizes of ``config.backend`` (``'archon:d2t2'``); data parallel over the
    whole world when it is empty."""
    spec = config.backend or f"archon:d{world_size}"
    alloc = ParallelStrategy.parse_backend(spec, field_name="TrainEngineConfig.backend")
    if alloc.backend != "archon":
        raise ValueError(
            f"TrainEngineConfig.backend={spec!r}: ArchonEngine needs an 'archon:...' backend"
        )
    ps = alloc.parallel
    if ps.world_size != world_size:
        raise ValueError(
            f"TrainEngineConfig.backend={spec!r} needs d*t*c*p = {ps.world_size} processes; "
            f"this process group has world_size={world_size}"
        )
    return ps


class ArchonEngine(ArchonPipelineMixin, FSDPEngine):
    """``TrainEngine`` on DeviceMesh / DTensor / FSDP2 (module docstring)."""

    def __init__(self, config: Any):
        super().__init__(config)
        self.parallel_dims: ArchonParallelDims | None = None
        self.state_dict_adapter = None
        # MoE: the load-balancing loss's coefficient in training (0: not added) and the
        # last training forward's loss
        self._aux_coef = 0.0
        self._last_aux: torch.Tensor | None = None
        self.share_prefixes = False

    # ------------------------------------------------------------------ build
    def _build_model(self) -> nn.Module:
        from transformers import AutoConfig

        path = self._check_model_path()
        self.dtype = self._resolve_dtype()
        ps = archon_layout(self.config, dist.get_world_size())
        hf = AutoConfig.from_pretrained(path)
        check_layout(
            hf, tp=ps.tp_size, cp=ps.cp_size, ep=ps.ep_size, pp=ps.pp_size, etp=ps.etp_size
        )
        ac = self.config.archon
        ac.refuse_unsupported("ArchonEngine", self.config.gradient_checkpointing)
        if self.config.use_lora:
            raise ValueError("TrainEngineConfig.use_lora=True is not supported by ArchonEngine")
        if self.config.enable_tree_training:
            raise ValueError(
                "TrainEngineConfig.enable_tree_training=True is not supported by ArchonEngine; "
                "use the FSDP engine (backend 'fsdp:...') for tree training"
            )
        if ac.use_deterministic_algorithms:
            torch.use_deterministic_algorithms(True)
        dims = ArchonParallelDims(
            dp_shard=ps.dp_size,
            cp=ps.cp_size,
            tp=ps.tp_size,
            pp=ps.pp_size,
            ep=ps.ep_size,
            etp=ps.etp_size,
            world_size=dist.get_world_size(),
            device_type=self.device.type,
            ep_spans_cp_tp=ps.hybrid_moe and ps.etp_size == 1,
        )
        dims.build_mesh()
        self.parallel_dims = dims
        spec = get_model_spec(hf.model_type)
        args = spec.model_args_class.from_hf_config(hf, is_critic=self.is_critic)
        self.state_dict_adapter = spec.state_dict_adapter_class(args)
        if args.n_experts and getattr(hf, "output_router_logits", False):
            # transformers' rule: the aux loss joins the training loss with output_router_logits
            self._aux_coef = float(hf.router_aux_loss_coef)
        if ac.router_replay and not args.n_experts:
            raise ValueError(
                f"archon.router_replay=True needs a mixture-of-experts model; this "
                f"{hf.model_type} model is dense"
            )
        t0 = time.perf_counter()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)  # the same initial weights on every rank
            model = spec.model_class(args)
        if not self.config.init_from_scratch:
            self._load_hf_weights(model, path)
        if self.is_critic:
            hf.num_labels = 1
        self.model_config = hf
        self._tie_word_embeddings = args.tie_word_embeddings
        self._top_k = int(args.top_k) if args.n_experts else 0
        model = model.to(self.device)
        ac_every = 0
        if self.config.gradient_checkpointing and ac.ac_mode != "none":
            ac_every = 1 if ac.ac_mode == "full" else int(ac.selective_ac_option)
        parallel_kw = dict(
            param_dtype=self.dtype,
            reduce_dtype=DTYPES.get(self.config.grad_reduce_dtype, torch.float32),
            reshard_after_forward=ac.reshard_after_forward_policy != "never",
            ac_every=ac_every,
            ac_preserve_rng_state=ac.ac_preserve_rng_state,
        )
        if dims.pp_enabled:
            model = self._build_pipeline(model, spec, dims, args, **parallel_kw)
        else:
            spec.parallelize_fn(model, dims, **parallel_kw)
        self._mesh = dims.get_mesh("dp_shard_cp")
        logger.info(
            "%s (%s) built in %.2fs: dp_shard=%d tp=%d cp=%d ep=%d pp=%d, %.2fM params "
            "(this rank), critic=%s",
            spec.name,
            type(model).__name__,
            time.perf_counter() - t0,
            dims.dp_shard,
            dims.tp,
            dims.cp,
            dims.ep,
            dims.pp,
            sum(p.numel() for p in model.parameters()) / 1e6,
            self.is_critic,
        )
        return model

    def _load_hf_weights(self, model: nn.Module, path: str) -> None:
        from safetensors.torch import load_file

        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path!r}")
        hf_sd: dict[str, torch.Tensor] = {}
        for f in files:
            hf_sd.update(load_file(os.path.join(path, f)))
        if self.is_critic:  # a causal LM's head is not a value head: start a fresh one
            hf_sd.pop("lm_head.weight", None)
        sd = {k: v.float() for k, v in self.state_dict_adapter.from_hf(hf_sd).items()}
        missing, unexpected = model.load_state_dict(sd, strict=False)
        allowed_missing = {"output.weight"} if self.is_critic else set()
        if set(missing) - allowed_missing or unexpected:
            raise ValueError(
                f"HF checkpoint {path!r} does not match the archon model: missing "
                f"{sorted(set(missing) - allowed_missing)[:6]}, unexpected {sorted(unexpected)[:6]}"
            )
        if self.is_critic and "output.weight" in missing:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(1)  # the same fresh value head on every rank
                nn.init.normal_(model.output.weight, std=0.02)

    # ------------------------------------------------------------------ parallelism
    def _dims(self) -> ArchonParallelDims:
        if self.parallel_dims is None:
            raise RuntimeError("ArchonEngine is not initialized; call initialize() first")
        return self.parallel_dims

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        return self._dims().get_group("dp_shard")

    @property
    def data_parallel_rank(self) -> int:
        return self._dims().get_mesh("dp_shard").get_local_rank()

    @property
    def data_parallel_world_size(self) -> int:
        return self._dims().dp_shard

    def is_data_parallel_head(self) -> bool:
        dims = self._dims()
        return all(dims.get_mesh(n).get_local_rank() == 0 for n in ("cp", "tp", "pp"))

    @property
    def parallelism_group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    # ------------------------------------------------------------------ compute
    def _forward_packed(self, mb: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed micro-batch -> (logprobs, entropy) or (values, None), each ``[n_tokens]``.

        Under context parallelism the stream is padded to a multiple of cp, each rank runs
        its consecutive part, and the per-token results are gathered (differentiably).
        With pipeline stages: forward only, stage to stage (``_pp_forward_packed``)."""
        if self._pp_stages is not None:
            return self._pp_forward_packed(mb)
        model = self._require_model()
        dims = self._dims()
        ids, pos = mb["input_ids"], mb["position_ids"]
        cu = mb["cu_seqlens"].long()
        n = ids.shape[0]
        labels = torch.roll(ids, shifts=-1)
        routed = self._routed_experts(mb)
        cp = dims.cp
        if cp > 1:
            pad = (-n) % cp
            ids_p, pos_p, lab_p = (F.pad(t, (0, pad)) for t in (ids, pos, labels))
            r = dims.get_mesh("cp").get_local_rank()
            part = (n + pad) // cp
            sl = slice(r * part, (r + 1) * part)
            ids_l, pos_l, lab_l = ids_p[sl], pos_p[sl], lab_p[sl]
            if routed is not None:
                routed = F.pad(routed, (0, 0, 0, 0, 0, pad))[sl]
        else:
            ids_l, pos_l, lab_l = ids, pos, labels
        if routed is not None:
            out = model(ids_l, pos_l, cu, routed_experts=routed)
        else:
            out = model(ids_l, pos_l, cu)
        if self._aux_coef > 0 and model.training:  # this rank's tokens, as transformers' batch
            self._last_aux = model.aux_loss()
        if self.is_critic:
            vals = out[:, 0].float()
            if cp > 1:
                vals = gather_seq(vals, dims.get_group("cp"))[:n]
            return vals, None
        logits = out.float() / self.temperature
        logp = torch.log_softmax(logits, dim=-1)
        lp = logp.gather(-1, lab_l[:, None])[:, 0]
        with torch.no_grad():
            ent = -(logp.exp() * logp).sum(-1)
        if cp > 1:
            group = dims.get_group("cp")
            lp = gather_seq(lp, group)[:n]
            ent = gather_seq(ent, group)[:n]
        # row i scores token i + 1: shift so row i scores token i, 0 at sequence starts
        pred = torch.stack([lp, ent], dim=-1)
        shifted = torch.roll(pred, shifts=1, dims=0)
        is_first = torch.zeros(n, dtype=torch.bool, device=ids.device)
        is_first[cu[:-1]] = True
        shifted = torch.where(is_first[:, None], torch.zeros_like(shifted), shifted)
        return shifted[:, 0], shifted[:, 1].detach()

    def _routed_experts(self, mb: dict[str, Any]) -> torch.Tensor | None:
        """With ``archon.router_replay``: the micro-batch's ``[n, n_moe_layers, top_k]``
        expert ids from the rollout (None without replay)."""
        if not self.config.archon.router_replay:
            return None
        if "routed_experts" not in mb:
            raise ValueError(
                "archon.router_replay=True needs the batch's 'routed_experts' (ask the "
                "inference server for return_routed_experts)"
            )
        routed = mb["routed_experts"].long()
        if routed.ndim == 2:  # SGLang's flat rows: [n, n_moe_layers * top_k]
            routed = routed.reshape(routed.shape[0], -1, self._top_k)
        return routed

    def train_batch(self, input_, loss_fn, loss_weight_fn) -> dict[str, float]:
        """``FSDPEngine.train_batch``; an MoE model whose HF config sets
        ``output_router_logits`` adds ``router_aux_loss_coef`` x its load-balancing loss
        (over each micro-batch's tokens on this rank) to every micro-batch's loss. With
        pipeline stages: a ``torch.distributed.pipelining`` schedule (``_pp_train_batch``)."""
        if self._pp_stages is not None:
            return self._pp_train_batch(input_, loss_fn, loss_weight_fn)
        if self._aux_coef <= 0:
            return super().train_batch(input_, loss_fn, loss_weight_fn)
        coef = self._aux_coef

        def with_aux(out, ent, mb):
            return loss_fn(out, ent, mb) + coef * self._last_aux

        return super().train_batch(input_, with_aux, loss_weight_fn)

    def optimizer_step(self) -> dict[str, float]:
        """Clip gradients (global norm over every mesh, and over the pipeline stages) to
        ``gradient_clipping``; step."""
        if self.optimizer is None:
            raise RuntimeError("this engine has no optimizer (config.optimizer is None)")
        max_norm = float(self.config.optimizer.gradient_clipping or math.inf)
        pp_group = self._pp_group() if self._pp_stages is not None else None
        params = list(self._require_model().parameters())
        grad_norm = clip_grad_norm_(params, max_norm, sum_group=pp_group)
        return self._step_if_finite(grad_norm)

    # ------------------------------------------------------------------ export names
    def _export_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters by HuggingFace name (sharded DTensors; tied weights once)."""
        model = self._require_model()
        named = {
            k.replace("_checkpoint_wrapped_module.", ""): v for k, v in model.named_parameters()
        }
        return self.state_dict_adapter.to_hf(named)

    def _load_hf(self, path: str) -> None:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path!r}")
        hf_sd: dict[str, torch.Tensor] = {}
        for f in files:
            hf_sd.update(load_file(os.path.join(path, f)))
        sd = {k: v.float() for k, v in self.state_dict_adapter.from_hf(hf_sd).items()}
        model = self._require_model()
        if self._pp_stages is not None:  # this rank's stages only
            own = {k.replace("_checkpoint_wrapped_module.", "") for k in model.state_dict()}
            sd = {k: v for k, v in sd.items() if k in own}
        set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True))

    def _save_hf(self, path: str, tokenizer: Any = None) -> None:
        if self._pp_stages is not None:
            return self._pp_save_hf(path, tokenizer)
        return super()._save_hf(path, tokenizer)

    def export_weight_shards(self, path: str, shard_mb: float = 128) -> int:
        """The sharded export: tensors gathered bucket by bucket (``shard_mb`` MiB each,
        each tensor gathered once), bucket ``i`` written by rank ``i % world_size`` as
        ``model-rank{r}-{i:05d}.safetensors`` (every rank of every dimension takes a turn:
        the files are disjoint and together hold every tensor once); rank 0 also writes
        the config. Returns the bytes this rank wrote. Collective over all ranks. With
        pipeline stages each stage exports its own tensors (``_pp_export_weight_shards``)."""
        if self._pp_stages is not None:
            return self._pp_export_weight_shards(path, shard_mb)
        rank, world = dist.get_rank(), dist.get_world_size()
        if rank == 0:
            os.makedirs(path, exist_ok=True)
            for f in os.listdir(path):  # an earlier export's shards
                if f.endswith(".safetensors"):
                    os.remove(os.path.join(path, f))
        dist.barrier()
        written = 0
        limit = max(1, int(float(shard_mb) * (1 << 20)))
        for i, (specs, tensors) in enumerate(self._gather_buckets(limit)):
            if i % world != rank:
                continue
            named = {sp.name: t for sp, t in zip(specs, tensors, strict=True)}
            write_safetensors(named, os.path.join(path, f"model-rank{rank}-{i:05d}.safetensors"))
            written += sum(t.numel() * t.element_size() for t in tensors)
        if rank == 0:
            cfg = self.model_config
            cfg.use_cache = True
            cfg.save_pretrained(path)
            cfg.use_cache = False
        dist.barrier()
        return written

    def _dcp_options(self) -> Any:
        """Flattened optimizer state (per-parameter keys, hyper-parameters included), so
        a checkpoint reshards across layouts where ranks hold different parameters
        (pipeline stages: saved at p2, loaded at p1 or d2)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=True)

    def save(self, meta: SaveLoadMeta) -> None:
        super().save(meta)
        dist.barrier()  # rank 0 writes; every rank (tp and cp peers too) returns after

    def load(self, meta: SaveLoadMeta) -> None:
        super().load(meta)
        dist.barrier()
