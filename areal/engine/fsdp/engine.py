"""FSDP2 training engine for transformers causal LMs (and value models).

One process per data-parallel rank (``torchrun`` or any launcher that sets ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). Each decoder layer and the root model
are sharded with ``fully_shard``; gloo on CPU, NCCL on CUDA.

Batches are padded tensor dicts (see ``areal.utils.data``). Each rank passes its *own*
part of the global batch; losses are weighted across ranks so the update equals one
computed on the whole batch.

Loss functions
--------------
Actor (``is_critic=False``): ``loss_fn(logprobs, entropy, input_data) -> scalar``, where
``logprobs``/``entropy`` are 1-D ``[n_tokens]`` float32, aligned with the packed
``input_ids`` (``logprobs[i] = log p(input_ids[i] | earlier tokens of its sequence)``,
computed from ``logits / temperature``; 0 at the first token of each sequence; the
entropy is that of the distribution that predicts token i and carries no gradient). ``input_data`` is the
packed micro-batch: per-token keys 1-D ``[n_tokens]``, per-sequence keys ``[n_seqs]``,
plus ``cu_seqlens``, ``max_seqlen``, ``position_ids``.

Critic (``is_critic=True``): ``loss_fn(values, None, input_data) -> scalar`` with
``values`` ``[n_tokens]`` float32, the value head's output at each token (no shift).

``loss_fn`` returns the MEAN loss of its micro-batch and ``loss_weight_fn(input_data)``
that micro-batch's weight (e.g. its number of loss tokens); the engine scales each
micro-batch by ``weight / total weight of all micro-batches of all ranks``.

Attention over packed micro-batches: ``flash_attention_2`` varlen on CUDA when flash_attn
is installed (untested here), otherwise ``areal.engine.fsdp.attention.varlen_sdpa_attention``
(causal SDPA per sequence); both receive ``cu_seq_lens_q/k`` from the engine. With the
latter, sequences of a micro-batch that start with the same tokens (GRPO's samples of
one prompt) run their shared prefix once (``plan_shared_prefixes``: exact, 1.8x less
CPU per ``train_batch`` on the demo's batches; ``engine.share_prefixes = False`` turns
it off). With ``enable_tree_training`` the micro-batches are packed as prefix tries of any
depth (``attention.plan_tree_training``; ``mb_spec.max_tokens_per_mb`` counts the stored
trie tokens; ``pad_to_maximum`` pads each trie to it): agent rows that repeat the
conversation so far, DPO/RW pairs and GRPO groups store each shared token once (exact);
where the trie is one level deep (pairs, groups) the one-level plan's kernels run it.
Qwen2-VL-family actors (``engine.dedup_images``, on by default) run each distinct image
of a micro-batch through the vision tower once (GRPO's samples of one prompt carry equal
copies) and pack shared prefixes with their images once too (``vision_inputs.py``:
exact; ``dedup_images = False`` is the old path, every copy through the tower).
Logprobs are computed inside the model's forward by ``ChunkedLogprobHead`` (which
replaces ``lm_head`` and keeps its weight), so no ``[tokens, vocab]`` logits tensor is
held for long micro-batches.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from areal.api.engine_api import InferenceEngine, TrainEngine
from areal.api.engine_config import TrainEngineConfig
from areal.api.io_struct import FinetuneSpec, WeightUpdateMeta
from areal.engine.fsdp.attention import (
    VARLEN_SDPA,
    plan_shared_prefixes,
    plan_tree_training,
    register_varlen_sdpa,
)
from areal.engine.fsdp.checkpoint import FSDPCheckpointMixin
from areal.engine.fsdp.fingerprints import FSDPFingerprintMixin
from areal.engine.fsdp.logprob_head import ChunkedLogprobHead
from areal.engine.fsdp.parallelize import apply_fsdp2, lr_lambda
from areal.engine.fsdp.tree_attention import TreePlan
from areal.engine.fsdp.vision_inputs import VisionFeatureInjector, language_model_of, pack_images
from areal.engine.fsdp.weight_delta import FSDPWeightDeltaMixin
from areal.engine.fsdp.weight_export import DTYPES as _DTYPES
from areal.engine.fsdp.weight_export import FSDPWeightExportMixin
from areal.engine.fsdp.weight_push import FSDPWeightPushMixin
from areal.utils import logging, stats_tracker
from areal.utils.cpu_info import cpu_compute_dtype
from areal.utils.data import (
    MicroBatchList,
    get_seqlens,
    pad_packed_tensor,
    split_padded_tensor_dict_into_mb_list,
    unpack_sequence,
)

logger = logging.getLogger("FSDPEngine")


class FSDPEngine(
    FSDPCheckpointMixin,
    FSDPWeightExportMixin,
    FSDPWeightDeltaMixin,
    FSDPWeightPushMixin,
    FSDPFingerprintMixin,
    TrainEngine,
):
    """``TrainEngine`` on PyTorch FSDP2 (``fully_shard``) over the default process group.

    Training lives here; checkpoints, the weight export (full and delta), the push parts
    and the fingerprint digests are the mixins of this folder (one module each)."""

    def __init__(self, config: TrainEngineConfig):
        self.config = config
        self.model: nn.Module | None = None
        self.model_config: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.ft_spec: FinetuneSpec | None = None
        self.device = torch.device("cpu")
        self.is_critic = bool(config.is_critic)
        self.is_vlm = False  # set by _build_model for Qwen2-VL-family checkpoints
        self.temperature = float(config.temperature or 1.0)
        self.logprob_chunk_size = 1024
        self.hf_shard_mb = 128  # safetensors shard size of HF saves (gather/write overlap)
        self._version = 0
        self._own_process_group = False
        self._initialized = False
        self._head: ChunkedLogprobHead | None = None
        self._tie_word_embeddings = False
        self.inference_engine: InferenceEngine | None = None
        self.weight_update_meta: WeightUpdateMeta | None = None
        self._weight_update_group: dist.ProcessGroup | None = None
        self._weight_update_group_key: tuple | None = None
        self.dtype = torch.float32
        self._lora_scale: float | None = None  # set when the model carries a LoRA adapter
        self._attn_impl = ""
        # Pack the leading tokens that sequences of a micro-batch share once (GRPO's
        # samples of one prompt): exact, used with the CPU packed attention only.
        self.share_prefixes = True
        # VLM actors: each distinct image of a micro-batch through the vision tower once,
        # and shared prefixes (images included) packed once (vision_inputs.py); False:
        # every sample's copy through the tower, no prefix sharing (the old path).
        self.dedup_images = True
        self._vision_inputs: VisionFeatureInjector | None = None

    # ------------------------------------------------------------------ lifecycle
    def create_process_group(self, parallel_strategy: Any = None) -> None:
        """Initialise the default process group from ``RANK``/``WORLD_SIZE``/``MASTER_*``.

        Without those variables a single-process group is made (127.0.0.1, free port).
        Backend: NCCL when CUDA is available, else gloo.
        """
        torch.set_num_threads(int(self.config.num_threads or 1))
        if torch.cuda.is_available():
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
        if dist.is_initialized():
            return
        if "RANK" not in os.environ:
            from areal.utils.dist import find_free_port

            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(find_free_port()))
            os.environ["RANK"] = "0"
            os.environ["WORLD_SIZE"] = "1"
            os.environ.setdefault("LOCAL_RANK", "0")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
        self._own_process_group = True
        logger.info("process group ready: backend=%s world_size=%d", backend, dist.get_world_size())

    def initialize(
        self, addr: str | None = None, ft_spec: FinetuneSpec | None = None, **kwargs
    ) -> None:
        """Load the model from ``config.path``, shard it, build optimizer and LR schedule."""
        if self._initialized:
            raise RuntimeError("FSDPEngine.initialize called twice")
        self._check_model_path()
        if not dist.is_initialized():
            self.create_process_group()
        if kwargs.get("seed") is not None:
            # Same base seed on every rank; per-step randomness derives from it
            # (areal.utils.seeding.request_seed) so that a resumed run is reproducible.
            from areal.utils.seeding import set_random_seed

            set_random_seed(int(kwargs["seed"]))
        torch.set_num_threads(int(self.config.num_threads or 1))
        self.ft_spec = ft_spec
        self.model = self._build_model()
        self._build_optimizer(ft_spec)
        self._initialized = True

    def _check_model_path(self) -> str:
        path = self.config.path or ""
        if not path or not os.path.isdir(path):
            raise FileNotFoundError(
                f"TrainEngineConfig.path={path!r} is not a local model directory "
                "(expected a HuggingFace folder with config.json)"
            )
        if not os.path.exists(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"TrainEngineConfig.path={path!r} has no config.json")
        return path

    def _resolve_attn_impl(self) -> str:
        """flash_attention_2 (varlen via cu_seq_lens) on CUDA when flash_attn is installed;
        otherwise the per-sequence SDPA of ``areal.engine.fsdp.attention.varlen_sdpa_attention``."""
        want = self.config.attn_impl or "flash_attention_2"
        if self.config.enable_tree_training:
            # the trie's ancestor mask runs on our SDPA attention (any device)
            return register_varlen_sdpa()
        if want == "flash_attention_2" and self.device.type == "cuda":
            try:
                import flash_attn  # noqa: F401

                return want
            except ImportError:
                logger.info("flash_attn not installed: using per-sequence SDPA for packed batches")
        if want not in ("flash_attention_2", "sdpa", VARLEN_SDPA):
            logger.warning(
                "attn_impl=%s does not support packed batches; using %s", want, VARLEN_SDPA
            )
        return register_varlen_sdpa()

    def _resolve_dtype(self) -> torch.dtype:
        name = self.config.dtype or "float32"
        if name not in _DTYPES:
            raise ValueError(f"TrainEngineConfig.dtype={name!r}; allowed: {sorted(_DTYPES)}")
        dtype = _DTYPES[name]
        if self.device.type == "cpu":
            return cpu_compute_dtype(self.config.cpu_compute_dtype, requested=name)
        return dtype

    def _hf_config_and_class(self, path: str) -> tuple[Any, type]:
        """The model's HF config (dropout off when ``disable_dropout``; one label for a
        critic) and the transformers class that builds it (sets ``is_vlm``)."""
        from transformers import (
            AutoConfig,
            AutoModelForCausalLM,
            AutoModelForTokenClassification,
        )

        from areal.models import multimodal as mm

        hf_config = AutoConfig.from_pretrained(path)
        if self.config.disable_dropout:
            for k in (
                "attention_dropout",
                "hidden_dropout",
                "dropout",
                "resid_pdrop",
                "embd_pdrop",
            ):
                if hasattr(hf_config, k):
                    setattr(hf_config, k, 0.0)
        self.is_vlm = mm.is_qwen_vl_config(hf_config)
        if self.is_critic:
            hf_config.num_labels = 1
            return hf_config, AutoModelForTokenClassification
        if self.is_vlm:
            return hf_config, mm.model_class_for(hf_config)
        return hf_config, AutoModelForCausalLM

    def _build_model(self) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from areal.models import multimodal as mm

        path = self._check_model_path()
        self.dtype = self._resolve_dtype()
        attn = self._attn_impl = self._resolve_attn_impl()
        hf_config, cls = self._hf_config_and_class(path)
        load_kwargs = dict(dtype=torch.float32, attn_implementation=attn)
        t0 = time.perf_counter()
        if self.config.init_from_scratch:
            # Every rank must start from the same weights: seed identically.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(1)
                model = cls.from_config(hf_config, **load_kwargs)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(1)  # a critic's fresh value head must match on all ranks
                model = cls.from_pretrained(path, config=hf_config, **load_kwargs)
        self.model_config = model.config
        if self.is_vlm:
            mm.use_sdpa_in_vision_tower(model)
            if not self.is_critic:
                self._vision_inputs = VisionFeatureInjector(mm.vision_tower(model))
                language_model_of(model).register_forward_pre_hook(
                    self._vision_inputs, with_kwargs=True
                )
            if self.config.freeze_vision_tower:
                n_frozen = mm.freeze_vision_tower(model)
                logger.info("vision tower frozen (%d parameters)", n_frozen)
        self._tie_word_embeddings = bool(getattr(model.config, "tie_word_embeddings", False))
        if self.config.disable_dropout:
            for m in model.modules():
                if isinstance(m, nn.Dropout):
                    m.p = 0.0
        if self.config.gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        if not self.is_critic:
            head = model.get_output_embeddings()
            if head is None or not hasattr(head, "weight"):
                raise ValueError(f"model at {path!r} has no output embedding (lm_head)")
            self._head = ChunkedLogprobHead(head, chunk_size=self.logprob_chunk_size)
            model.set_output_embeddings(self._head)
        model.config.use_cache = False
        if self.config.use_lora:
            from areal.engine.lora import wrap_lora
            from areal.models.lora_adapter import lora_scale

            if self.is_critic:
                raise ValueError("TrainEngineConfig.use_lora=True is not supported for critics")
            model = wrap_lora(model, self.config)
            self._lora_scale = lora_scale(self.config.lora_rank, self.config.lora_alpha)
        if self.device.type == "cuda":
            model = model.to(self.device)
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(
            param_dtype=self.dtype,
            reduce_dtype=_DTYPES.get(self.config.grad_reduce_dtype, torch.float32),
        )
        wrap = self.config.fsdp.wrap_policy
        names = getattr(wrap, "transformer_layer_cls_to_wrap", None) if wrap else None
        apply_fsdp2(model, mesh, mp_policy=mp, layer_cls_names=names)
        self._mesh = mesh
        n_params = sum(p.numel() for p in model.parameters())
        logger.info(
            "model %s loaded and sharded in %.2fs: %.2fM params, dtype=%s, attn=%s, critic=%s",
            type(model).__name__,
            time.perf_counter() - t0,
            n_params / 1e6,
            self.dtype,
            attn,
            self.is_critic,
        )
        return model

    def _build_optimizer(self, ft_spec: FinetuneSpec | None) -> None:
        oc = self.config.optimizer
        if oc is None:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        if oc.type in ("adam", "adam_bf16"):
            self.optimizer = torch.optim.AdamW(
                params,
                lr=oc.lr,
                weight_decay=oc.weight_decay,
                betas=(oc.beta1, oc.beta2),
                eps=oc.eps,
                # multi-tensor kernels: torch picks them only for CUDA tensors by default;
                # on CPU they cut AdamW.step of the tiny model from ~14 ms to ~5 ms
                foreach=True if self.device.type == "cpu" else None,
            )
        elif oc.type == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=oc.lr, weight_decay=oc.weight_decay)
        else:
            raise ValueError(
                f"OptimizerConfig.type={oc.type!r}; allowed: 'adam', 'sgd', 'adam_bf16'"
            )
        total = ft_spec.total_train_steps if ft_spec is not None else 1
        warmup = oc.warmup_length(total)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lr_lambda(oc.lr_scheduler_type, total, warmup, getattr(oc, "min_lr_ratio", 0.0)),
        )

    def destroy(self) -> None:
        if self.has_pending_save():  # shutdown waits for the background checkpoint write
            logger.info("destroy: waiting for the pending background checkpoint write")
            try:
                self.wait_async_save()
            except Exception as e:  # the previous complete checkpoint stays the valid one
                logger.error(f"destroy: the background checkpoint write failed: {e}")
        self._ckpt_group = None
        self._weight_update_group = None
        self.model = None
        self.optimizer = None
        self.lr_scheduler = None
        self._initialized = False
        if self._own_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._own_process_group = False

    def train(self, mode: bool = True) -> FSDPEngine:
        self._require_model().train(mode)
        return self

    # ------------------------------------------------------------------ parallelism
    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    @property
    def data_parallel_rank(self) -> int:
        return dist.get_rank()

    @property
    def data_parallel_world_size(self) -> int:
        return dist.get_world_size()

    def is_data_parallel_head(self) -> bool:
        return True

    @property
    def parallelism_group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    # ------------------------------------------------------------------ compute
    def _require_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("FSDPEngine is not initialized; call initialize() first")
        return self.model

    def _to_device(self, data: dict[str, Any]) -> dict[str, Any]:
        if self.device.type == "cpu":
            return data
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in data.items()}

    def _split(self, input_: dict[str, Any]) -> MicroBatchList:
        return split_padded_tensor_dict_into_mb_list(
            input_,
            self.config.mb_spec,
            group=self.data_parallel_group,
            name="input_",
            tree=self.config.enable_tree_training and not self.is_critic,
        )

    def _forward_packed(self, mb: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed micro-batch -> (logprobs, entropy) or (values, None), each ``[n_tokens]``."""
        model = self._require_model()
        ids = mb["input_ids"]
        pos = mb["position_ids"]
        cu = mb["cu_seqlens"]
        varlen = dict(
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=int(mb["max_seqlen"]),
            max_length_k=int(mb["max_seqlen"]),
        )
        extra: dict[str, Any] = {"position_ids": pos[None]}
        images = None  # the fast VLM path's distinct images (vision_inputs.pack_images)
        if self.is_vlm:
            from areal.models.multimodal import MM_KEY, packed_multimodal_kwargs

            entries = mb.get(MM_KEY) or [{}] * (cu.numel() - 1)
            if self.dedup_images and not self.is_critic:
                images = pack_images(model, ids, cu, entries)
                extra = {"position_ids": images.position_ids}
            else:
                extra = packed_multimodal_kwargs(model, ids, cu, entries)
        if self.is_critic:
            out = model(input_ids=ids[None], use_cache=False, **extra, **varlen)
            return out.logits[0, :, 0].float(), None
        cu = cu.long()
        labels = torch.roll(ids, shifts=-1)
        positions = extra["position_ids"]  # [1, N] (text) or [3, 1, N] (M-RoPE)
        plan = None
        if images is not None or not self.is_vlm:
            plan = self._shared_prefix_plan(ids if images is None else images.keys, cu, positions)
        pick = None
        token_rows = images.token_rows if images is not None else None
        if plan is None:
            self._head.request(labels, self.temperature)
            inputs = ids[None]
        else:  # samples of one prompt: the shared prefix runs once (exact, see the plan)
            # one head row per distinct (hidden row, next token): a shared prefix's
            # logprobs are computed once, then copied to every member
            v = self._head.out_features
            uniq, pick = torch.unique(plan.back * v + labels, return_inverse=True)
            self._head.request(uniq % v, self.temperature, rows=uniq // v)
            inputs = ids.index_select(0, plan.src)[None]
            seg = torch.tensor(plan.seg_cu, dtype=torch.int32, device=ids.device)
            extra = {"position_ids": positions.index_select(-1, plan.src)}
            if token_rows is not None:
                token_rows = token_rows.index_select(0, plan.src)
            key = "tree_plan" if isinstance(plan, TreePlan) else "shared_prefix_plan"
            varlen = {
                "cu_seq_lens_q": seg, "cu_seq_lens_k": seg, "max_length_q": plan.seg_len,
                "max_length_k": plan.seg_len, key: plan,
            }  # fmt: skip
        if images is not None:
            self._vision_inputs.request(images.pixel_values, images.image_grid_thw, token_rows)
        try:
            out = model(input_ids=inputs, use_cache=False, **extra, **varlen)
        finally:
            self._head.request(None)
            if images is not None:
                self._vision_inputs.request(None, None, None)
        pred = out.logits[0]  # [N, 2]: row i scores token i + 1
        if pick is not None:
            pred = pred.index_select(0, pick)
        shifted = torch.roll(pred, shifts=1, dims=0)  # row i scores token i
        is_first = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        is_first[cu[:-1]] = True
        shifted = torch.where(is_first[:, None], torch.zeros_like(shifted), shifted)
        return shifted[:, 0], shifted[:, 1]

    def _shared_prefix_plan(
        self, keys: torch.Tensor, cu: torch.Tensor, positions: torch.Tensor | None = None
    ) -> Any:
        """The shared-prefix layout of a packed micro-batch, or None (off, not our CPU
        attention, too little shared, or positions that differ inside a shared prefix).

        ``keys`` are the token ids (text) or :func:`pack_images`' keys (VLM: equal only
        where the tokens and the images are); ``positions`` (VLM: ``[3, 1, N]``) are checked
        to agree inside every shared prefix when given (the engine always gives them)."""
        if self._attn_impl != VARLEN_SDPA:
            return None
        if self.config.enable_tree_training:
            budget = int(self.config.mb_spec.max_tokens_per_mb or 0)
            pad = budget if self.config.pad_to_maximum else 0
            plan = plan_tree_training(keys, cu, pad_to=pad, budget=budget)
        elif not self.share_prefixes:
            return None
        else:
            plan = plan_shared_prefixes(keys, cu)
        if plan is not None and self.is_vlm and positions is not None:
            # M-RoPE positions depend on the images before a token: a shared row must
            # have the same position in every member (guaranteed by the keys; checked)
            if not torch.equal(positions.index_select(-1, plan.src)[..., plan.back], positions):
                return None
        return plan

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.data_parallel_world_size > 1:
            dist.all_reduce(t, group=self.data_parallel_group)
        return t

    def _mb_weights(
        self, mbs: list[dict[str, Any]], loss_weight_fn: Callable
    ) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.stack(
            [
                torch.as_tensor(loss_weight_fn(mb), dtype=torch.float64).reshape(()).cpu()
                for mb in mbs
            ]
        )
        total = self._all_reduce_sum(w.sum().reshape(1).to(self._reduce_device()))[0].cpu()
        if not bool(total > 0):
            raise ValueError(
                f"total loss weight over all micro-batches and ranks is {float(total)}; "
                "loss_weight_fn must give a positive total (e.g. some loss_mask tokens)"
            )
        return w, total

    def _reduce_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def train_batch(
        self,
        input_: dict[str, Any],
        loss_fn: Callable[..., torch.Tensor],
        loss_weight_fn: Callable[[dict[str, Any]], Any],
    ) -> dict[str, float]:
        model = self._require_model()
        if self.optimizer is None:
            raise RuntimeError("train_batch needs config.optimizer (this engine has none)")
        model.train()
        mb_list = self._split(input_)
        mbs = [self._to_device(mb) for mb in mb_list.packed()]
        weights, total = self._mb_weights(mbs, loss_weight_fn)
        dp = self.data_parallel_world_size
        self.optimizer_zero_grad()
        loss_acc = torch.zeros((), dtype=torch.float64, device=self._reduce_device())
        for i, mb in enumerate(mbs):
            model.set_requires_gradient_sync(i == len(mbs) - 1)
            out, ent = self._forward_packed(mb)
            loss = loss_fn(out, ent, mb)
            if not torch.is_tensor(loss) or loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar tensor, got {loss!r:.80}")
            scale = float(weights[i] / total) * dp
            (loss * scale).backward()
            loss_acc += loss.detach().double() * float(weights[i] / total)
        model.set_requires_gradient_sync(True)
        stats = self.optimizer_step()
        loss_t = self._all_reduce_sum(loss_acc.reshape(1))
        stats["loss"] = float(loss_t[0])
        return stats

    def optimizer_zero_grad(self) -> None:
        if self.optimizer is None:
            raise RuntimeError("this engine has no optimizer (config.optimizer is None)")
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> dict[str, float]:
        """Clip gradients to ``optimizer.gradient_clipping`` and step (skipped if not finite)."""
        if self.optimizer is None:
            raise RuntimeError("this engine has no optimizer (config.optimizer is None)")
        max_norm = float(self.config.optimizer.gradient_clipping or math.inf)
        params = [p for p in self._require_model().parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        grad_norm = float(norm)
        return self._step_if_finite(grad_norm)

    def _step_if_finite(self, grad_norm: float) -> dict[str, float]:
        """The optimizer step after clipping: skipped (logged) when ``grad_norm`` is not
        finite; gradients zeroed either way."""
        lr = float(self.optimizer.param_groups[0]["lr"])
        ok = math.isfinite(grad_norm)
        if ok:
            self.optimizer.step()
        else:
            logger.warning("non-finite gradient norm %s: optimizer step skipped", grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "lr": lr, "update_successful": float(ok)}

    def step_lr_scheduler(self) -> None:
        if self.lr_scheduler is None:
            raise RuntimeError("this engine has no LR scheduler (config.optimizer is None)")
        self.lr_scheduler.step()

    def scale_lr(self, factor: float) -> float:
        """The learning rate times ``factor`` from now on: every parameter group's ``lr``
        and the schedule's ``base_lrs`` (saved with it, so a resumed run keeps it)."""
        if self.optimizer is None:
            raise RuntimeError("this engine has no optimizer (config.optimizer is None)")
        for group in self.optimizer.param_groups:
            group["lr"] *= factor
            if "initial_lr" in group:
                group["initial_lr"] *= factor
        if self.lr_scheduler is not None:
            self.lr_scheduler.base_lrs = [lr * factor for lr in self.lr_scheduler.base_lrs]
            self.lr_scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        return float(self.optimizer.param_groups[0]["lr"])

    @torch.no_grad()
    def eval_batch(
        self,
        input_: dict[str, Any],
        loss_fn: Callable[..., torch.Tensor],
        loss_weight_fn: Callable[[dict[str, Any]], Any],
    ) -> torch.Tensor:
        """Weighted mean of the micro-batch losses over all ranks (same weighting as training)."""
        model = self._require_model()
        was_training = model.training
        model.eval()
        try:
            mb_list = self._split(input_)
            mbs = [self._to_device(mb) for mb in mb_list.packed()]
            weights, total = self._mb_weights(mbs, loss_weight_fn)
            acc = torch.zeros((), dtype=torch.float64)
            for i, mb in enumerate(mbs):
                out, ent = self._forward_packed(mb)
                acc += loss_fn(out, ent, mb).detach().double().cpu() * float(weights[i] / total)
            return self._all_reduce_sum(acc.reshape(1).to(self._reduce_device()))[0].cpu().float()
        finally:
            model.train(was_training)

    @torch.no_grad()
    def forward_batch(
        self,
        input_: dict[str, Any],
        output_seqlens: list[int] | None = None,
        post_hook: Callable[..., Any] | None = None,
        aggregate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> Any:
        """Per-token logprobs (values for a critic) of ``input_``, padded ``[B, T]`` float32.

        ``out[b, i] = log p(input_ids[b, i] | input_ids[b, <i])`` at ``self.temperature``;
        0 at ``i = 0`` and on padding. ``post_hook(output, input_data)`` (optional) maps each
        packed micro-batch's ``[n_tokens]`` output to another per-token tensor
        ``[n_tokens, ...]``. ``aggregate_fn`` (optional) receives the list of per-sequence
        results in the original row order instead of padding them, e.g. ``torch.cat``
        gives a packed result. ``output_seqlens``, when given, must equal the
        ``attention_mask`` lengths (checked).
        """
        model = self._require_model()
        mb_list = self._split(input_)  # validates input_ on every rank before collectives
        lens = get_seqlens(input_["attention_mask"])
        if output_seqlens is not None and list(output_seqlens) != lens.tolist():
            raise ValueError(
                f"output_seqlens {list(output_seqlens)[:8]}... != attention_mask lengths "
                f"{lens.tolist()[:8]}..."
            )
        was_training = model.training
        model.eval()
        try:
            pieces: list[torch.Tensor] = []
            for mb in mb_list.packed():
                mb = self._to_device(mb)
                out, _ = self._forward_packed(mb)
                if post_hook is not None:
                    out = post_hook(out, mb)
                pieces.extend(unpack_sequence(out.cpu(), mb["cu_seqlens"].cpu()))
        finally:
            model.train(was_training)
        ordered = [pieces[i] for i in mb_list.backward_indices.tolist()]
        if aggregate_fn is not None:
            return aggregate_fn(ordered)
        cat = torch.cat(ordered, dim=0)
        cu = torch.zeros(lens.numel() + 1, dtype=torch.long)
        cu[1:] = lens.cpu().cumsum(0)
        return pad_packed_tensor(cat, cu, max_len=input_["attention_mask"].shape[1])

    # ------------------------------------------------------------------ misc
    def set_version(self, version: int) -> None:
        self._version = int(version)

    def get_version(self) -> int:
        return self._version

    def export_stats(self) -> dict[str, float]:
        return stats_tracker.export_all(reduce_group=self.data_parallel_group)

    def offload(self) -> None:
        """No-op (weights stay where they are; CPU runs have nothing to offload)."""

    def onload(self) -> None:
        """No-op (see ``offload``)."""
