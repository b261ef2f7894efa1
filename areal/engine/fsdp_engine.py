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
is installed (untested here), otherwise ``areal.utils.fsdp.varlen_sdpa_attention``
(causal SDPA per sequence); both receive ``cu_seq_lens_q/k`` from the engine. With the
latter, sequences of a micro-batch that start with the same tokens (GRPO's samples of
one prompt) run their shared prefix once (``plan_shared_prefixes``: exact, 1.8x less
CPU per ``train_batch`` on the demo's batches; ``engine.share_prefixes = False`` turns
it off).
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
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from areal.api.engine_api import InferenceEngine, TrainEngine
from areal.api.io_struct import FinetuneSpec, ParamSpec, SaveLoadMeta, WeightUpdateMeta
from areal.utils import logging
from areal.utils.data import (
    MicroBatchList,
    get_seqlens,
    pad_packed_tensor,
    split_padded_tensor_dict_into_mb_list,
    unpack_sequence,
)
from areal.utils.dist import broadcast_tensor, init_custom_process_group
from areal.utils.fsdp import (
    VARLEN_SDPA,
    ChunkedLogprobHead,
    apply_fsdp2,
    lr_lambda,
    plan_shared_prefixes,
    register_varlen_sdpa,
)

logger = logging.getLogger("FSDPEngine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_NAME = "model.safetensors"
_SAFETENSORS_INDEX = "model.safetensors.index.json"
#: Exports at least this large digest (verified weight sync) on a thread of their own,
#: alongside the shard writes; smaller ones inline (measured on the demo model: a thread
#: adds ~1 ms to a 4 MB export, saves ~3 ms of a 116 MB one).
_DIGEST_THREAD_MIN_BYTES = 32 << 20
#: Deferred digests (``enable_weight_fingerprints(deferred=True)``) hold the exported
#: tensors until a thread digested them (``_finish_reference``); exports larger than this (the
#: held tensors may be copies, e.g. cast on the GPU) are digested during the export.
_DEFER_DIGEST_MAX_BYTES = 1 << 30
#: ... and so are exports smaller than this: their digests (~0.3 ms on the demo model) cost
#: less than the thread's start, hand-offs and second file write.
_DEFER_DIGEST_MIN_BYTES = 32 << 20
_EXTRA_STATE_NAME = "engine_extra_state.pt"


def _wait(fut: Any, what: str, timeout: float | None = None) -> Any:
    if fut is None:
        return None
    if isinstance(fut, Future) or hasattr(fut, "result"):
        try:
            return fut.result(timeout=timeout)
        except Exception as e:  # re-raised with context
            raise RuntimeError(f"{what} failed: {e}") from e
    return fut


_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(
    tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None
) -> None:
    """Write CPU tensors as a safetensors file straight from their memory (no staging copy).

    Same format as ``safetensors.torch.save_file`` (8-byte header length, JSON header,
    raw little-endian data); readable by ``safe_open``/``load_file``/``from_pretrained``.
    """
    import json
    import struct

    header: dict[str, Any] = {}
    offset = 0
    flat = []
    for name, t in tensors.items():
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype} that safetensors cannot store")
        t = t.detach().contiguous().cpu()
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
        flat.append(t.reshape(-1).view(torch.uint8))
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in flat:
            if t.numel():
                f.write(t.numpy().data)


def bucket_param_specs(specs: list[ParamSpec], limit_bytes: int) -> list[list[ParamSpec]]:
    """Group specs, in order, into buckets of at most ``limit_bytes`` (a larger tensor gets
    a bucket of its own)."""
    if limit_bytes <= 0:
        raise ValueError(f"limit_bytes={limit_bytes}; must be > 0")
    buckets: list[list[ParamSpec]] = []
    cur: list[ParamSpec] = []
    cur_bytes = 0
    for spec in specs:
        nbytes = spec.size_bytes
        if cur and cur_bytes + nbytes > limit_bytes:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(spec)
        cur_bytes += nbytes
    if cur:
        buckets.append(cur)
    return buckets


class FSDPEngine(TrainEngine):
    """``TrainEngine`` on PyTorch FSDP2 (``fully_shard``) over the default process group."""

    def __init__(self, config: Any):
        self.config = config
        self.model: nn.Module | None = None
        self.model_config: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.ft_spec: FinetuneSpec | None = None
        self.device = torch.device("cpu")
        self.is_critic = bool(getattr(config, "is_critic", False))
        self.is_vlm = False  # set by _build_model for Qwen2-VL-family checkpoints
        self.temperature = float(getattr(config, "temperature", 1.0) or 1.0)
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

    # ------------------------------------------------------------------ lifecycle
    def create_process_group(self, parallel_strategy: Any = None) -> None:
        """Initialise the default process group from ``RANK``/``WORLD_SIZE``/``MASTER_*``.

        Without those variables a single-process group is made (127.0.0.1, free port).
        Backend: NCCL when CUDA is available, else gloo.
        """
        torch.set_num_threads(int(getattr(self.config, "num_threads", 1) or 1))
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
        torch.set_num_threads(int(getattr(self.config, "num_threads", 1) or 1))
        self.ft_spec = ft_spec
        self.model = self._build_model()
        self._build_optimizer(ft_spec)
        self._initialized = True

    def _check_model_path(self) -> str:
        path = getattr(self.config, "path", "") or ""
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
        otherwise the per-sequence SDPA of ``areal.utils.fsdp.varlen_sdpa_attention``."""
        want = getattr(self.config, "attn_impl", "flash_attention_2") or "flash_attention_2"
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
        name = getattr(self.config, "dtype", "float32") or "float32"
        if name not in _DTYPES:
            raise ValueError(f"TrainEngineConfig.dtype={name!r}; allowed: {sorted(_DTYPES)}")
        dtype = _DTYPES[name]
        if self.device.type == "cpu" and dtype != torch.float32:
            logger.info("dtype=%s requested; training in float32 on CPU", name)
            dtype = torch.float32
        return dtype

    def _build_model(self) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from transformers import (
            AutoConfig,
            AutoModelForCausalLM,
            AutoModelForTokenClassification,
        )

        path = self._check_model_path()
        self.dtype = self._resolve_dtype()
        attn = self._attn_impl = self._resolve_attn_impl()
        hf_config = AutoConfig.from_pretrained(path)
        if getattr(self.config, "disable_dropout", False):
            for k in (
                "attention_dropout",
                "hidden_dropout",
                "dropout",
                "resid_pdrop",
                "embd_pdrop",
            ):
                if hasattr(hf_config, k):
                    setattr(hf_config, k, 0.0)
        from areal.engine import multimodal as mm

        self.is_vlm = mm.is_qwen_vl_config(hf_config)
        if self.is_critic:
            hf_config.num_labels = 1
            cls = AutoModelForTokenClassification
        elif self.is_vlm:
            cls = mm.model_class_for(hf_config)
        else:
            cls = AutoModelForCausalLM
        load_kwargs = dict(dtype=torch.float32, attn_implementation=attn)
        t0 = time.perf_counter()
        if getattr(self.config, "init_from_scratch", False):
            # Every rank must start from the same weights: seed identically.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(getattr(self.config, "seed", 1) or 1))
                model = cls.from_config(hf_config, **load_kwargs)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(1)  # a critic's fresh value head must match on all ranks
                model = cls.from_pretrained(path, config=hf_config, **load_kwargs)
        self.model_config = model.config
        if self.is_vlm:
            mm.use_sdpa_in_vision_tower(model)
            if getattr(self.config, "freeze_vision_tower", False):
                n_frozen = mm.freeze_vision_tower(model)
                logger.info("vision tower frozen (%d parameters)", n_frozen)
        self._tie_word_embeddings = bool(getattr(model.config, "tie_word_embeddings", False))
        if getattr(self.config, "disable_dropout", False):
            for m in model.modules():
                if isinstance(m, nn.Dropout):
                    m.p = 0.0
        if getattr(self.config, "gradient_checkpointing", False):
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
        if getattr(self.config, "use_lora", False):
            from areal.engine.lora import lora_scale, wrap_lora

            if self.is_critic:
                raise ValueError("TrainEngineConfig.use_lora=True is not supported for critics")
            model = wrap_lora(model, self.config)
            self._lora_scale = lora_scale(self.config.lora_rank, self.config.lora_alpha)
        if self.device.type == "cuda":
            model = model.to(self.device)
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(
            param_dtype=self.dtype,
            reduce_dtype=_DTYPES.get(
                getattr(self.config, "grad_reduce_dtype", "float32"), torch.float32
            ),
        )
        wrap = getattr(getattr(self.config, "fsdp", None), "wrap_policy", None)
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
        oc = getattr(self.config, "optimizer", None)
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
        warmup = int(getattr(oc, "warmup_steps_proportion", 0.0) * total)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lr_lambda(oc.lr_scheduler_type, total, warmup, getattr(oc, "min_lr_ratio", 0.0)),
        )

    def destroy(self) -> None:
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
            getattr(self.config, "mb_spec", None),
            group=self.data_parallel_group,
            name="input_",
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
        if self.is_vlm:
            from areal.engine.multimodal import MM_KEY, packed_multimodal_kwargs

            entries = mb.get(MM_KEY) or [{}] * (cu.numel() - 1)
            extra = packed_multimodal_kwargs(model, ids, cu, entries)
        if self.is_critic:
            out = model(input_ids=ids[None], use_cache=False, **extra, **varlen)
            return out.logits[0, :, 0].float(), None
        cu = cu.long()
        labels = torch.roll(ids, shifts=-1)
        plan = self._shared_prefix_plan(ids, cu)
        pick = None
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
            extra = {"position_ids": pos.index_select(0, plan.src)[None]}
            varlen = dict(
                cu_seq_lens_q=seg, cu_seq_lens_k=seg, max_length_q=plan.seg_len,
                max_length_k=plan.seg_len, shared_prefix_plan=plan,
            )  # fmt: skip
        try:
            out = model(input_ids=inputs, use_cache=False, **extra, **varlen)
        finally:
            self._head.request(None)
        pred = out.logits[0]  # [N, 2]: row i scores token i + 1
        if pick is not None:
            pred = pred.index_select(0, pick)
        shifted = torch.roll(pred, shifts=1, dims=0)  # row i scores token i
        is_first = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        is_first[cu[:-1]] = True
        shifted = torch.where(is_first[:, None], torch.zeros_like(shifted), shifted)
        return shifted[:, 0], shifted[:, 1]

    def _shared_prefix_plan(self, ids: torch.Tensor, cu: torch.Tensor) -> Any:
        """The shared-prefix layout of a packed text micro-batch, or None (off, not our
        CPU attention, or too little shared)."""
        if not self.share_prefixes or self.is_vlm or self._attn_impl != VARLEN_SDPA:
            return None
        return plan_shared_prefixes(ids, cu)

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
        max_norm = float(getattr(self.config.optimizer, "gradient_clipping", 0.0) or math.inf)
        params = [p for p in self._require_model().parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        grad_norm = float(norm)
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

    # ------------------------------------------------------------------ state dicts
    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) state dict on rank 0, ``{}`` elsewhere. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(
            self._require_model(), options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self._tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        return sd

    def _export_dtype(self) -> torch.dtype:
        name = getattr(self.config, "dtype", "float32") or "float32"
        return _DTYPES.get(name, torch.float32) if self.device.type == "cuda" else torch.float32

    def _gather_buckets(self, limit_bytes: int, digest_pool: Any = None, defer: bool = False):
        """Yield ``(specs, full_tensors)`` bucket by bucket (export dtype, contiguous).

        Collective: every rank iterates (each ``full_tensor`` is an all-gather); the
        tensors are full on every rank. Order: ``named_parameters`` (tied weights once),
        then persistent buffers. ``digest_pool`` (a one-thread executor): the weight
        fingerprint digests run there, alongside what the caller does with each bucket
        (e.g. writing it), and are waited for at the end. ``defer``: they are not taken;
        the tensors are kept (``self._export_held``) for ``_finish_reference``.
        """
        from areal.utils.weight_fingerprint import WeightDigests, rotation_share

        self._join_deferred_digests()  # the last export's digests read those tensors
        dt = self._export_dtype()
        named = self._export_tensors()
        # verified weight sync (enable_weight_fingerprints): digests taken while each
        # tensor is at hand (rank 0), in full for this check's rotation share
        self._export_digests = digests = None
        every = getattr(self, "_fingerprint_every", 0)
        if every:
            sizes = getattr(self, "_fingerprint_sizes", None)
            if sizes is None or len(sizes) != len(named):  # the model's names and sizes
                sizes = self._fingerprint_sizes = [(n, t.numel()) for n, t in named.items()]
            share = rotation_share(sizes, every, self._fingerprint_checks)
            digests = WeightDigests(
                dist.get_rank() == 0,
                share,
                self._fingerprint_dtypes,
                getattr(self, "_fingerprint_views", None),
            )
        pending = []
        held: list[tuple[str, torch.Tensor]] | None = [] if defer else None
        self._export_held = None
        for bucket in bucket_param_specs(self._export_specs(named), limit_bytes):
            tensors = []
            for spec in bucket:
                t = named[spec.name].detach()
                full = t.full_tensor() if hasattr(t, "full_tensor") else t
                tensors.append(full.to(dt).contiguous())
                if digests is not None and not hasattr(self, "_fingerprint_views"):
                    # exports that are the live parameters themselves (one CPU rank, no
                    # cast): the digests keep their sampled positions across exports
                    local = t.to_local() if hasattr(t, "to_local") else t
                    alias = tensors[-1].data_ptr() == local.data_ptr()
                    self._fingerprint_views = {} if alias else None
                    digests._views = self._fingerprint_views
            if digests is not None and digests.enabled:
                items = list(zip((spec.name for spec in bucket), tensors))
                if held is not None:
                    held.extend(items)
                elif digest_pool is not None:
                    pending.append(digest_pool.submit(digests.add, items))
                else:
                    digests.add(items)
            yield bucket, tensors
        for f in pending:
            f.result()
        if digests is not None:
            digests.complete = held is None
            self._export_held = held if digests.enabled else None
        self._export_digests = digests

    def _save_hf(self, path: str, tokenizer: Any = None) -> None:
        """Gather bucket by bucket; rank 0 writes each safetensors shard in a background
        thread while the next bucket is gathered. One shard is named ``model.safetensors``;
        more get ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``."""
        import json
        from concurrent.futures import ThreadPoolExecutor

        from areal.utils.weight_fingerprint import REFERENCE_FILE

        rank0 = dist.get_rank() == 0
        t0 = time.perf_counter()
        if rank0:
            os.makedirs(path, exist_ok=True)
            for f in os.listdir(path):  # stale shards (and reference) of an earlier save
                if f.endswith(".safetensors") or f in (_SAFETENSORS_INDEX, REFERENCE_FILE):
                    os.remove(os.path.join(path, f))
        shard_bytes = max(1, int(self.hf_shard_mb * (1 << 20)))
        shards: list[tuple[str, list[str], int]] = []
        pool = ThreadPoolExecutor(max_workers=1) if rank0 else None
        # the fingerprint digests (verified weight sync) alongside the shard writes, for
        # exports large enough that this saves more than a thread's hand-offs cost
        digest_pool = None
        defer = False  # digests taken on a thread after the save (_finish_reference)
        if rank0 and getattr(self, "_fingerprint_every", 0):
            if getattr(self, "_model_bytes", None) is None:  # walks the modules: once
                self._model_bytes = sum(
                    p.numel() * p.element_size() for p in self._require_model().parameters()
                )
            defer = (
                getattr(self, "_fingerprint_deferred", False)
                and _DEFER_DIGEST_MIN_BYTES <= self._model_bytes <= _DEFER_DIGEST_MAX_BYTES
                and self._is_weight_update_path(path)
            )
            if self._model_bytes >= _DIGEST_THREAD_MIN_BYTES and not defer:
                digest_pool = ThreadPoolExecutor(max_workers=1)
        futs = []
        try:
            buckets = self._gather_buckets(shard_bytes, digest_pool, defer)
            for i, (specs, tensors) in enumerate(buckets):
                if not rank0:
                    continue
                tmp_name = f"shard-{i:05d}.safetensors.tmp"
                names = [sp.name for sp in specs]
                shards.append((tmp_name, names, sum(t.numel() * t.element_size() for t in tensors)))
                futs.append(
                    pool.submit(
                        write_safetensors,
                        dict(zip(names, tensors)),
                        os.path.join(path, tmp_name),
                        {"format": "pt"},
                    )
                )
            for f in futs:
                f.result()
        finally:
            for p in (pool, digest_pool):
                if p is not None:
                    p.shutdown(wait=True)
        if rank0:
            n = len(shards)
            weight_map: dict[str, str] = {}
            for i, (tmp_name, names, _) in enumerate(shards):
                final = _SAFETENSORS_NAME if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                os.replace(os.path.join(path, tmp_name), os.path.join(path, final))
                weight_map.update(dict.fromkeys(names, final))
            if n > 1:
                index = {
                    "metadata": {"total_size": sum(b for *_, b in shards)},
                    "weight_map": weight_map,
                }
                with open(os.path.join(path, _SAFETENSORS_INDEX), "w") as f:
                    json.dump(index, f, indent=1, sort_keys=True)
            logger.debug("HF save to %s: %d shard(s) in %.2fs", path, n, time.perf_counter() - t0)
            cfg = self.model_config
            cfg.use_cache = True
            cfg.save_pretrained(path)
            cfg.use_cache = False
            gen = getattr(self._require_model(), "generation_config", None)
            if gen is not None and not self.is_critic:
                try:
                    gen.save_pretrained(path)
                except Exception as e:  # generation config is optional
                    logger.warning("generation_config not saved: %s", e)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
            self._write_fingerprint_reference(path)
        dist.barrier(group=self.data_parallel_group)
        if self._lora_scale is not None:  # the merged weights above + the adapter itself
            self.save_lora_adapter(os.path.join(path, "lora_adapter"))

    def _load_hf(self, path: str) -> None:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        files = (
            sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if os.path.isdir(path)
            else []
        )
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path!r}")
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(os.path.join(path, f)))
        model = self._require_model()
        if self._tie_word_embeddings and "lm_head.weight" not in sd:
            emb_key = next((k for k in sd if k.endswith("embed_tokens.weight")), None)
            if emb_key is not None:
                sd["lm_head.weight"] = sd[emb_key]
        sd = {k: v.to(torch.float32) for k, v in sd.items()}
        set_model_state_dict(
            model, sd, options=StateDictOptions(full_state_dict=True, strict=False)
        )

    def _dcp_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        model = self._require_model()
        if self.optimizer is not None:
            msd, osd = get_state_dict(model, self.optimizer)
            return msd, osd
        return get_model_state_dict(model), {}

    def save(self, meta: SaveLoadMeta) -> None:
        """``hf``: full weights (+ config, tokenizer) written by rank 0. ``dcp``: sharded
        model (+ optimizer and LR scheduler with ``with_optim``) for exact resume."""
        if meta.weight_format == "hf":
            self._save_hf(meta.path, meta.tokenizer)
            return
        import torch.distributed.checkpoint as dcp

        msd, osd = self._dcp_state()
        state: dict[str, Any] = {"model": msd}
        if meta.with_optim:
            if self.optimizer is None:
                raise ValueError("SaveLoadMeta.with_optim=True but this engine has no optimizer")
            state["optim"] = osd
        os.makedirs(meta.path, exist_ok=True)
        dcp.save(state, checkpoint_id=meta.path)
        if dist.get_rank() == 0:
            extra = {"version": self._version}
            if meta.with_optim and self.lr_scheduler is not None:
                extra["lr_scheduler"] = self.lr_scheduler.state_dict()
            torch.save(extra, os.path.join(meta.path, _EXTRA_STATE_NAME))
        if meta.tokenizer is not None and dist.get_rank() == 0:
            meta.tokenizer.save_pretrained(meta.path)
        dist.barrier(group=self.data_parallel_group)

    def load(self, meta: SaveLoadMeta) -> None:
        if not os.path.isdir(meta.path):
            raise FileNotFoundError(f"SaveLoadMeta.path={meta.path!r} does not exist")
        if meta.weight_format == "hf":
            self._load_hf(meta.path)
            dist.barrier(group=self.data_parallel_group)
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        msd, osd = self._dcp_state()
        state: dict[str, Any] = {"model": msd}
        if meta.with_optim:
            if self.optimizer is None:
                raise ValueError("SaveLoadMeta.with_optim=True but this engine has no optimizer")
            state["optim"] = osd
        dcp.load(state, checkpoint_id=meta.path)
        model = self._require_model()
        if meta.with_optim:
            set_state_dict(
                model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
            )
        else:
            set_model_state_dict(model, state["model"])
        extra_path = os.path.join(meta.path, _EXTRA_STATE_NAME)
        if os.path.exists(extra_path):
            extra = torch.load(extra_path, weights_only=False)
            self._version = int(extra.get("version", self._version))
            if meta.with_optim and self.lr_scheduler is not None and "lr_scheduler" in extra:
                self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        dist.barrier(group=self.data_parallel_group)

    # ------------------------------------------------------------------ weight sync
    def connect_engine(self, engine: InferenceEngine, meta: WeightUpdateMeta) -> None:
        self.inference_engine = engine
        self.weight_update_meta = meta

    def _export_tensors(self) -> dict[str, torch.Tensor]:
        """Exported tensors by HF name (sharded DTensors for parameters): parameters in
        ``named_parameters`` order (tied weights once, so a tied ``lm_head.weight`` is left
        out), then persistent buffers."""
        model = self._require_model()
        named: dict[str, torch.Tensor] = dict(model.named_parameters())
        sd_keys = set(model.state_dict().keys())
        for name, buf in model.named_buffers():
            if name in sd_keys and name not in named:
                named[name] = buf
        if self._lora_scale is not None:
            from areal.engine.lora import merged_export_tensors

            # HF names, adapter merged into the targeted weights (W0 + s * B @ A)
            return merged_export_tensors(named, self._lora_scale)
        return named

    def save_lora_adapter(self, path: str) -> int:
        """Write only the LoRA adapter (peft layout) to ``path`` on rank 0; collective.
        Returns the adapter's bytes (0 on other ranks)."""
        from areal.engine.lora import adapter_tensors, write_adapter

        self._export_digests = None  # the merged weights were not exported this time
        named = adapter_tensors(dict(self._require_model().named_parameters()))
        full = {
            k: (v.detach().full_tensor() if hasattr(v, "full_tensor") else v.detach()).to(
                self._export_dtype()
            )
            for k, v in named.items()
        }
        n = 0
        if dist.get_rank() == 0:
            targets = sorted(
                {k.split(".lora_A.")[0].rsplit(".", 1)[-1] for k in full if ".lora_A." in k}
            )
            n = write_adapter(path, full, self.config.lora_rank, self.config.lora_alpha, targets)
        dist.barrier(group=self.data_parallel_group)
        return n

    def _export_specs(self, named: dict[str, torch.Tensor]) -> list[ParamSpec]:
        dt_name = str(self._export_dtype()).removeprefix("torch.")
        return [ParamSpec(n, tuple(int(x) for x in t.shape), dt_name) for n, t in named.items()]

    @torch.no_grad()
    def enable_weight_fingerprints(
        self,
        full_every: int = 1,
        dtypes: dict[str, str] | None = None,
        reference_root: str | None = None,
        deferred: bool = False,
    ) -> None:
        """Digest every later export for ``weights_fingerprint`` (verified weight sync):
        row sums of a ``1/full_every`` share of the tensors, rotating with every answered
        check (or written reference), plus a strided sample of every tensor; in
        ``dtypes[name]`` (the dtype the servers hold) when given. ``full_every=0`` turns
        the digests off. ``reference_root``: HF saves below this directory (the disk
        weight updates) also get the reference file (``_write_fingerprint_reference``).
        ``deferred``: for those weight updates the file first only names the seed and the
        names digested in full (what the servers need, ``"deferred": true``); a thread then
        digests the kept exported tensors and completes it, off the save (exports of
        ``_DEFER_DIGEST_MIN_BYTES`` to ``_DEFER_DIGEST_MAX_BYTES``; others are digested
        during the export)."""
        if full_every < 0:
            raise ValueError(f"full_every={full_every}; must be >= 0")
        self._fingerprint_deferred = bool(deferred)
        self._fingerprint_every = int(full_every)
        self._fingerprint_dtypes = dict(dtypes or {})
        self._fingerprint_checks = getattr(self, "_fingerprint_checks", 0)
        self._fingerprint_root = os.path.realpath(reference_root) if reference_root else None

    def _write_fingerprint_reference(self, path: str) -> None:
        """Rank 0, after an HF save under the weight-update root given to
        ``enable_weight_fingerprints``: write the export's fingerprints for a fresh random
        seed into ``path`` (``weight_fingerprint.write_reference``), for the servers that
        load it and the verifying hook; the rotation moves on to the next share."""
        from areal.utils.weight_fingerprint import FULL_SAMPLE_MAX, write_reference, write_request

        digests = getattr(self, "_export_digests", None)
        if digests is None or not digests.enabled or not self._is_weight_update_path(path):
            return  # nothing digested, or a checkpoint, not a weight update
        held = getattr(self, "_export_held", None)
        seed = int.from_bytes(os.urandom(8), "little") >> 3
        if held is not None:  # deferred: the servers' request now, the digests later
            share = digests.full
            full = [
                n for n, t in held if t.numel() > FULL_SAMPLE_MAX and (share is None or n in share)
            ]
            write_request(path, seed, sorted(full))
            self._export_held = None
            # digested on a thread while the servers load; done before the next export
            # (joined there) and before the next optimizer step (the hook's flush waits
            # for the complete reference)
            import threading

            t = threading.Thread(
                target=self._finish_reference,
                args=(path, seed, digests, held),
                name="weight-digest",
                daemon=True,
            )
            t.start()
            self._deferred_export = t
        elif digests.complete:
            write_reference(path, seed, digests)
        else:
            return
        if not digests.counted:
            digests.counted = True
            self._fingerprint_checks += 1

    def _is_weight_update_path(self, path: str) -> bool:
        """``path`` is below the weight-update root of ``enable_weight_fingerprints``."""
        root = getattr(self, "_fingerprint_root", None)
        if not root:
            return False
        if os.path.abspath(path).startswith(root + os.sep):
            return True  # (realpath costs a syscall per path component)
        real = os.path.realpath(path)
        return os.path.commonpath([real, root]) == root and real != root

    def _finish_reference(self, path: str, seed: int, digests: Any, held: list) -> None:
        """Deferred digests (a thread of rank 0, started after the weight-update save):
        digest the kept tensors and replace the request in ``path`` by the complete
        reference; on failure the file says why (``"error"``)."""
        from areal.utils.weight_fingerprint import write_error, write_reference

        try:
            with torch.no_grad():
                digests.add(held)
            digests.complete = True
            write_reference(path, seed, digests, atomic=True)  # replaces the request
        except Exception as e:  # noqa: BLE001 - reported to the verifying hook
            logger.error("weight fingerprint digests of %s failed: %s", path, e)
            write_error(path, seed, str(e))

    def _join_deferred_digests(self) -> None:
        """Wait for the deferred digests of the last weight-update export, if running."""
        t = getattr(self, "_deferred_export", None)
        if t is not None:
            t.join()
            self._deferred_export = None

    def weights_fingerprint(
        self, seed: int = 0, dtypes: dict[str, str] | None = None, full: list[str] | None = None
    ) -> dict[str, list[float]]:
        """Fingerprints (``areal.utils.weight_fingerprint``) of the exported weights by HF
        name: in full for the names in ``full`` (``None``: all), else sampled, each in the
        export dtype or in ``dtypes[name]`` (the dtype a server holds).

        Without ``dtypes`` and ``full``, after an export digested by
        ``enable_weight_fingerprints``, they come from those digests (the weights the
        servers were sent), on rank 0 (other ranks answer ``{}``), and the next export
        takes the next rotation share in full. Otherwise collective: every rank
        all-gathers each tensor; same result on every rank."""
        from areal.utils.weight_fingerprint import fingerprint_tensor

        cached = getattr(self, "_export_digests", None)
        if cached is not None and cached.complete and dtypes is None and full is None:
            if not cached.counted:  # the next export takes the next share
                cached.counted = True
                self._fingerprint_checks += 1
            return cached.fingerprints(seed)
        out: dict[str, list[float]] = {}
        for name, t in self._export_tensors().items():
            whole = t.detach().full_tensor() if hasattr(t, "full_tensor") else t.detach()
            dt = (dtypes or {}).get(name)
            whole = whole.to(getattr(torch, dt) if dt else self._export_dtype())
            out[name] = fingerprint_tensor(name, whole, seed, full=full is None or name in full)
        return out

    def get_param_specs(self, weight_chunked_mem_mb: int = 1024) -> list[list[ParamSpec]]:
        """Export specs (full shapes, export dtype) in ``named_parameters`` order, bucketed
        so each bucket holds at most ``weight_chunked_mem_mb`` MiB (a larger tensor gets a
        bucket of its own)."""
        if weight_chunked_mem_mb <= 0:
            raise ValueError(f"weight_chunked_mem_mb={weight_chunked_mem_mb}; must be > 0")
        specs = self._export_specs(self._export_tensors())
        return bucket_param_specs(specs, int(weight_chunked_mem_mb) << 20)

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Push the current weights (``disk`` or ``xccl``, see ``areal.api.io_struct``).

        Collective: every training rank calls it; rank 0 talks to the inference engine.
        """
        if meta.type == "disk":
            self._update_weights_from_disk(meta)
        elif meta.type == "xccl":
            self._update_weights_from_distributed(meta)
        else:
            raise ValueError(f"WeightUpdateMeta.type={meta.type!r}; allowed: 'disk', 'xccl'")
        if meta.version is not None:
            self._version = int(meta.version)

    def _update_weights_from_disk(self, meta: WeightUpdateMeta) -> None:
        if not meta.path:
            raise ValueError("WeightUpdateMeta.path is required for a disk weight update")
        t0 = time.perf_counter()
        if getattr(meta, "use_lora", False):
            if self._lora_scale is None:
                raise ValueError("WeightUpdateMeta.use_lora=True but the model has no LoRA adapter")
            self.save_lora_adapter(meta.path)  # adapter only
        else:
            self._save_hf(meta.path)
        if dist.get_rank() == 0 and self.inference_engine is not None:
            fut = self.inference_engine.update_weights_from_disk(meta)
            _wait(fut, "inference_engine.update_weights_from_disk")
        dist.barrier(group=self.data_parallel_group)
        logger.info("disk weight update to %s done in %.2fs", meta.path, time.perf_counter() - t0)

    def _ensure_weight_update_group(self, meta: WeightUpdateMeta) -> None:
        key = (meta.master_address, meta.master_port, meta.group_name, meta.world_size)
        if self._weight_update_group is not None and self._weight_update_group_key == key:
            return
        if meta.world_size < 2:
            raise ValueError(
                f"WeightUpdateMeta.world_size={meta.world_size}; xccl needs 1 trainer + >= 1 "
                "inference worker (set it before update_weights)"
            )
        if not meta.master_port:
            raise ValueError("WeightUpdateMeta.master_port must be set for an xccl weight update")
        backend = meta.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        fut = None
        if self.inference_engine is not None:
            fut = self.inference_engine.init_weights_update_group(meta)
        self._weight_update_group = init_custom_process_group(
            backend,
            meta.master_address,
            meta.master_port,
            meta.world_size,
            rank=0,
            group_name=meta.group_name,
            timeout_s=meta.timeout_s,
        )
        self._weight_update_group_key = key
        _wait(fut, "inference_engine.init_weights_update_group")
        logger.info(
            "joined weight-update group %s (%s, world_size=%d) at %s:%d",
            meta.group_name,
            backend,
            meta.world_size,
            meta.master_address,
            meta.master_port,
        )

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> None:
        """``xccl``: training rank 0 joins the weight-update group (group rank 0, hosts the
        ``TCPStore``); other ranks return at once. A rendezvous: the inference servers must
        be joining at the same time (``InferenceEngine.init_weights_update_group``). Done
        lazily by the first ``update_weights`` when not called before."""
        if meta.type != "xccl":
            raise ValueError(f"init_weights_update_group needs type='xccl', got {meta.type!r}")
        if dist.get_rank() == 0:
            self._ensure_weight_update_group(meta)

    def _update_weights_from_distributed(self, meta: WeightUpdateMeta) -> None:
        t0 = time.perf_counter()
        rank0 = dist.get_rank() == 0
        if rank0:
            self._ensure_weight_update_group(meta)
        limit = int(meta.weight_chunked_mem_mb) << 20
        for bucket, tensors in self._gather_buckets(limit):
            if rank0:
                fut = None
                if self.inference_engine is not None:
                    fut = self.inference_engine.update_weights_from_distributed(meta, bucket)
                for t in tensors:
                    broadcast_tensor(self._weight_update_group, t, root=0)
                _wait(fut, "inference_engine.update_weights_from_distributed")
            del tensors
        dist.barrier(group=self.data_parallel_group)
        logger.info("xccl weight update done in %.2fs", time.perf_counter() - t0)

    # ------------------------------------------------------------------ misc
    def set_version(self, version: int) -> None:
        self._version = int(version)

    def get_version(self) -> int:
        return self._version

    def export_stats(self) -> dict[str, float]:
        try:
            from areal.utils import stats_tracker
        except ImportError:
            return {}
        return stats_tracker.export_all(reduce_group=self.data_parallel_group)

    def offload(self) -> None:
        """No-op (weights stay where they are; CPU runs have nothing to offload)."""

    def onload(self) -> None:
        """No-op (see ``offload``)."""
