"""Allocation mode: which backend runs each component, on how many devices, in which layout.

Syntax (AReaL's, with this project's built-in ``local`` inference server)::

    local:d1+fsdp:d2          inference on 1 device, FSDP training on 2 others
    sglang:d4p1t2+fsdp:d4     4 SGLang replicas of tensor-parallel 2, FSDP data-parallel 4
    vllm:d2+archon:d2t2       decoupled inference and training (archon: tensor parallel)
    sglang.d4+fsdp.d4         the older '.' separator is accepted as well as ':'
    vllm:d2|fsdp:d2           '|' : training and inference share the same devices
    d4                        training only (SFT), FSDP by default
    vllm:d2                   inference only (serving or evaluation)
    vllm[rollout]:d2+fsdp[actor]:d2   optional component names, looked up with mode["actor"]
    archon:(attn:d2t2|ffn:d2e2)       MoE hybrid form: attention layers on d2t2, expert
                                      layers on d2e2 over the same 4 ranks

A component is ``backend:dims`` where dims is a sequence of ``<letter><size>`` with
letters d (data), t (tensor), p (pipeline), c (context) and e (expert parallel), each at
most once, each size >= 1; omitted letters mean 1.

The MoE hybrid form ``backend:(attn:<dims>|ffn:<dims>)`` (AReaL's grammar; the
parentheses may be left out) gives the attention (dense) layers and the expert layers
their own layout over the same ranks: ``attn`` takes d, t, p, c; ``ffn`` takes d (the
expert data-parallel size, derived from the world size when omitted), e, t (expert
tensor parallel) and p (must equal attn's; inherited when omitted). The two halves must
need the same number of devices. It parses to one ``ParallelStrategy`` with attn's d, t,
p, c, ffn's e as ``expert_parallel_size``, ffn's t as ``expert_tensor_parallel_size`` and
``hybrid_moe=True`` (its ``str`` is the hybrid form again).

Which dimensions a training backend accepts is checked here, at parse time, before any
process starts (``check_train_dims``): ``fsdp`` takes only ``d``; ``archon`` takes ``d``,
``t``, ``c``, ``e`` and ``p`` (pipeline stages). There is no Megatron-LM engine here: a
``megatron`` component, and an ``fsdp`` one that names ``t``, ``c``, ``p`` or ``e``,
runs on ``archon`` (the PyTorch-native parallel engine, same dimensions) instead, with a
log line naming the mapping (``map_train_backend``).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal.api.engine_config import SchedulingStrategy

INFERENCE_BACKENDS = ("local", "sglang", "vllm")
TRAIN_BACKENDS = ("fsdp", "megatron", "archon")
_DIM_LETTERS = {
    "d": "data_parallel_size",
    "t": "tensor_parallel_size",
    "p": "pipeline_parallel_size",
    "c": "context_parallel_size",
    "e": "expert_parallel_size",
}
# Dimensions (letter -> size field) each training backend accepts beyond ``d``.
TRAIN_BACKEND_DIMS = {"fsdp": ("d",), "archon": ("d", "t", "c", "e", "p")}
_DIM_NAMES = {"d": "data", "t": "tensor", "p": "pipeline", "c": "context", "e": "expert"}
_COMPONENT_RE = re.compile(
    r"^(?P<backend>[A-Za-z_]+)(?:\[(?P<name1>[\w-]+)\]|\((?P<name2>[\w-]+)\))?(?P<sep>[:.])(?P<dims>.*)$"
)
_DIM_TOKEN_RE = re.compile(r"([a-z])(\d+)")
# The letters each half of the MoE hybrid form takes (AReaL's ATTN_DIM_TYPE / FFN_DIM_TYPE).
_HYBRID_LETTERS = {"attn": ("d", "t", "p", "c"), "ffn": ("d", "e", "t", "p")}
_HYBRID_RE = re.compile(r"^\(?\s*attn\s*:(?P<attn>[^|()]*)\|\s*ffn\s*:(?P<ffn>[^|()]*)\)?$")


class AllocationValidationError(ValueError):
    """A syntactically valid allocation that is inconsistent (e.g. two inference components)."""


class InvalidAllocationModeError(ValueError):
    """An allocation string that cannot be parsed."""


def map_train_backend(backend: str, parallel: ParallelStrategy, context: str) -> str:
    """The engine a training component runs on: ``megatron`` (AReaL 2.0 YAMLs) and
    ``fsdp`` with tensor / context / pipeline / expert dimensions run on ``archon``, the
    parallel engine with the same d/t/p/c/e dimensions; logged once per mapping."""
    from areal.api.config_common import warn_once

    extra = [x for x in ("t", "c", "p", "e") if getattr(parallel, _DIM_LETTERS[x]) > 1]
    if backend == "megatron" or (backend == "fsdp" and (extra or parallel.hybrid_moe)):
        why = (
            "this project has no Megatron-LM engine"
            if backend == "megatron"
            else f"the fsdp engine takes only d; {', '.join(extra) or 'the MoE hybrid form'} "
            "needs the parallel engine"
        )
        warn_once(
            f"backend-map-{backend}-{parallel}",
            f"{context}: '{backend}:{parallel}' runs on the parallel engine as "
            f"'archon:{parallel}' ({why}; same dimensions)",
        )
        return "archon"
    return backend


def check_train_dims(backend: str, parallel: ParallelStrategy, context: str) -> None:
    """Refuse a training component whose backend cannot build the layout it names."""
    if backend == "megatron":
        raise AllocationValidationError(
            f"{context}: backend 'megatron' is not available (this project has no "
            "Megatron-LM engine); use 'archon', the PyTorch-native engine with tensor, "
            f"context, expert and pipeline parallelism, e.g. 'archon:{parallel}'"
        )
    allowed = TRAIN_BACKEND_DIMS.get(backend)
    if allowed is None:
        return
    if parallel.hybrid_moe:
        _check_hybrid(backend, parallel, context)
        return
    ep, dp = parallel.ep_size, parallel.dp_size
    if backend == "archon" and ep > 1 and dp % ep:
        raise AllocationValidationError(
            f"{context}: expert parallelism e{ep} must divide data parallelism d{dp} (the "
            f"archon engine splits the experts over data-parallel ranks); allowed e: "
            f"{[e for e in range(1, dp + 1) if dp % e == 0]}"
        )
    for letter, name in _DIM_LETTERS.items():
        size = getattr(parallel, name)
        if size == 1 or letter in allowed:
            continue
        dims = ", ".join(f"{x} ({_DIM_NAMES[x]})" for x in allowed)
        hint = (
            f"; for {_DIM_NAMES[letter]} parallelism use 'archon:{parallel}'"
            if backend == "fsdp" and letter in TRAIN_BACKEND_DIMS["archon"]
            else ""
        )
        raise AllocationValidationError(
            f"{context}: the {backend} engine does not support {_DIM_NAMES[letter]} "
            f"parallelism ({letter}{size}); allowed dimensions: {dims}{hint}"
        )


def _check_hybrid(backend: str, parallel: ParallelStrategy, context: str) -> None:
    """What the archon engine builds of the MoE hybrid form: the experts sharded over
    ``e`` ranks that take every context and tensor rank (torchtitan's etp=1 layout: ep
    borrows the cp and tp ranks), FSDP-sharded over the ffn ``d`` ranks left."""
    if backend != "archon":
        raise AllocationValidationError(
            f"{context}: the MoE hybrid form '(attn:...|ffn:...)' needs the archon engine; "
            f"the {backend} engine takes only d; use 'archon:{parallel}'"
        )
    etp, ep = parallel.expert_tensor_parallel_size, parallel.ep_size
    if etp != 1:
        _check_expert_tp(parallel, context)
        return
    ct = parallel.cp_size * parallel.tp_size
    per_stage = parallel.world_size // parallel.pp_size
    if ep % ct:
        allowed = [e for e in range(ct, per_stage + 1, ct) if per_stage % e == 0]
        raise AllocationValidationError(
            f"{context}: ffn e{ep} must be a multiple of attn c*t = {ct} (expert "
            f"parallelism takes the context and tensor ranks of the attention layout); "
            f"allowed ffn e: {allowed}"
        )


def _check_expert_tp(parallel: ParallelStrategy, context: str) -> None:
    """The hybrid form with ffn ``t`` > 1 (expert tensor parallelism, torchtitan's
    etp = tp): each expert's hidden dimension split over the attention's tensor ranks,
    the experts over ``e`` data-parallel ranks (all of them, and no context parallelism:
    experts split both ways are not FSDP-sharded as well)."""
    etp, ep, tp = parallel.expert_tensor_parallel_size, parallel.ep_size, parallel.tp_size
    if etp != tp:
        raise AllocationValidationError(
            f"{context}: ffn t{etp} must equal attn t{tp} (expert tensor parallelism "
            f"splits each expert over the attention's tensor ranks); allowed ffn t: "
            f"{sorted({1, tp})}"
        )
    dp, cp = parallel.dp_size, parallel.cp_size
    if ep > 1 and (ep != dp or cp > 1):
        allowed = [1] + ([dp] if cp == 1 and dp > 1 else [])
        raise AllocationValidationError(
            f"{context}: ffn e{ep} with ffn t{etp}: the experts are split over all the "
            f"data-parallel ranks (attn d{dp}, with c1) or not at all; allowed ffn e: {allowed}"
        )


def _split_components(text: str, context: str) -> tuple[list[str], str]:
    """Split an allocation string into components at '+' / '|' outside parentheses; a
    bare hybrid ``attn:...|ffn:...`` stays one component. -> (components, separator)."""
    parts, seps, depth, start = [], [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise InvalidAllocationModeError(f"{context}: unbalanced ')' at position {i}")
        elif ch in "+|" and depth == 0:
            parts.append(text[start:i])
            seps.append(ch)
            start = i + 1
    if depth:
        raise InvalidAllocationModeError(f"{context}: unbalanced '(' (missing ')')")
    parts.append(text[start:])
    merged, kept = [parts[0]], []
    for sep, part in zip(seps, parts[1:], strict=True):
        if sep == "|" and part.strip().startswith("ffn") and "attn" in merged[-1]:
            merged[-1] = f"{merged[-1]}|{part}"
        else:
            merged.append(part)
            kept.append(sep)
    if len(set(kept)) > 1:
        raise InvalidAllocationModeError(f"{context}: mixing '+' and '|' is not supported")
    return merged, (kept[0] if kept else "+")


def _parse_sizes(dims: str, *, context: str, part: str | None = None) -> dict[str, int]:
    """``'d4t2'`` -> {size field: size}; ``part`` ('attn' / 'ffn'): a half of the MoE
    hybrid form, which takes only its own letters (``_HYBRID_LETTERS``)."""
    letters = _HYBRID_LETTERS[part] if part else tuple(_DIM_LETTERS)
    where = f"the {part} section " if part else ""
    listed = ", ".join(f"{x} ({_DIM_NAMES[x]})" for x in letters)
    if not dims:
        raise InvalidAllocationModeError(
            f"{context}: {where}has empty parallel dimensions; expected e.g. 'd2' or "
            f"'d4t2' (letters {listed})"
        )
    pos = 0
    sizes: dict[str, int] = {}
    for m in _DIM_TOKEN_RE.finditer(dims):
        if m.start() != pos:
            break
        letter, size = m.group(1), int(m.group(2))
        if letter not in letters:
            raise InvalidAllocationModeError(
                f"{context}: unknown parallel dimension {letter!r} in {where}{dims!r}; "
                f"allowed letters: {listed}"
            )
        if _DIM_LETTERS[letter] in sizes:
            raise InvalidAllocationModeError(
                f"{context}: dimension {letter!r} repeated in {where}{dims!r}"
            )
        if size < 1:
            raise InvalidAllocationModeError(
                f"{context}: size of {letter!r} in {where}{dims!r} is {size}; must be >= 1"
            )
        sizes[_DIM_LETTERS[letter]] = size
        pos = m.end()
    if pos != len(dims):
        raise InvalidAllocationModeError(
            f"{context}: cannot parse parallel dimensions {where}{dims!r} at {dims[pos:]!r}; "
            f"expected <letter><size> pairs such as 'd4t2' with letters {listed}"
        )
    return sizes


class AllocationType(enum.Enum):
    """How inference and training share devices."""

    COLOCATE = 0  # training and inference on the same devices (also: training only)
    DECOUPLED_TRAIN = 1  # separate devices for inference and training
    LLM_SERVER_ONLY = 2  # inference only


@dataclass
class ParallelStrategy:
    """Sizes of the parallel dimensions of one component."""

    tensor_parallel_size: int = field(default=1, metadata={"help": "Tensor-parallel size."})
    pipeline_parallel_size: int = field(default=1, metadata={"help": "Pipeline stages."})
    data_parallel_size: int = field(default=1, metadata={"help": "Data-parallel replicas."})
    context_parallel_size: int = field(
        default=1, metadata={"help": "Context (sequence) parallel size."}
    )
    expert_parallel_size: int = field(default=1, metadata={"help": "Expert-parallel size (MoE)."})
    expert_tensor_parallel_size: int = field(
        default=1,
        metadata={"help": "Tensor-parallel size of the expert layers (the hybrid form's ffn t)."},
    )
    hybrid_moe: bool = field(
        default=False,
        metadata={
            "help": "Parsed from the MoE hybrid form '(attn:...|ffn:...)': the expert layers "
            "have their own layout (e, ffn d) over the attention layout's ranks."
        },
    )

    def __post_init__(self):
        for name in (*_DIM_LETTERS.values(), "expert_tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"ParallelStrategy.{name}={value!r} is not allowed; must be an int >= 1"
                )

    @property
    def tp_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def pp_size(self) -> int:
        return self.pipeline_parallel_size

    @property
    def dp_size(self) -> int:
        return self.data_parallel_size

    @property
    def cp_size(self) -> int:
        return self.context_parallel_size

    @property
    def ep_size(self) -> int:
        return self.expert_parallel_size

    @property
    def etp_size(self) -> int:
        return self.expert_tensor_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """Ranks holding the same experts: the hybrid form's ffn d; else dp / ep."""
        if self.hybrid_moe:
            return self.world_size // (self.ep_size * self.etp_size * self.pp_size)
        return max(1, self.dp_size // self.ep_size)

    @property
    def world_size(self) -> int:
        """Devices needed: dp * cp * tp * pp (expert parallelism folds into these)."""
        return (
            self.data_parallel_size
            * self.context_parallel_size
            * self.tensor_parallel_size
            * self.pipeline_parallel_size
        )

    def __str__(self) -> str:
        if self.hybrid_moe:
            attn = f"d{self.dp_size}" + "".join(
                f"{k}{v}"
                for k, v in (("p", self.pp_size), ("t", self.tp_size), ("c", self.cp_size))
                if v != 1
            )
            ffn = f"d{self.expert_data_parallel_size}" + "".join(
                f"{k}{v}"
                for k, v in (("p", self.pp_size), ("t", self.etp_size), ("e", self.ep_size))
                if v != 1
            )
            return f"(attn:{attn}|ffn:{ffn})"
        dims = [f"d{self.dp_size}"]
        for letter, value in (
            ("p", self.pp_size),
            ("t", self.tp_size),
            ("c", self.cp_size),
            ("e", self.ep_size),
        ):
            if value != 1:
                dims.append(f"{letter}{value}")
        return "".join(dims)

    @classmethod
    def from_dims(cls, dims: str, *, context: str) -> ParallelStrategy:
        """``'d4t2'`` -> ParallelStrategy(dp=4, tp=2); ``context`` names the whole input in errors.
        The MoE hybrid form ``'(attn:d2t2|ffn:d2e2)'`` -> :meth:`from_hybrid`."""
        m = _HYBRID_RE.match(dims.strip())
        if m is not None:
            return cls.from_hybrid(m.group("attn"), m.group("ffn"), context=context)
        if "attn" in dims or "ffn" in dims or "(" in dims:
            raise InvalidAllocationModeError(
                f"{context}: cannot parse {dims!r}; the MoE hybrid form is "
                "'(attn:<d,t,p,c sizes>|ffn:<d,e,t,p sizes>)', e.g. '(attn:d2t2|ffn:d2e2)'"
            )
        return cls(**_parse_sizes(dims, context=context))

    @classmethod
    def from_hybrid(cls, attn: str, ffn: str, *, context: str) -> ParallelStrategy:
        """The MoE hybrid form's two halves (module docstring) -> one ParallelStrategy;
        AllocationValidationError when their world sizes or pipeline sizes differ."""
        a = _parse_sizes(attn.strip(), context=context, part="attn")
        f = _parse_sizes(ffn.strip(), context=context, part="ffn")
        dp, tp = a.get("data_parallel_size", 1), a.get("tensor_parallel_size", 1)
        pp, cp = a.get("pipeline_parallel_size", 1), a.get("context_parallel_size", 1)
        attn_world = dp * tp * pp * cp
        ep, etp = f.get("expert_parallel_size", 1), f.get("tensor_parallel_size", 1)
        fpp = f.get("pipeline_parallel_size", pp)
        if fpp != pp:
            raise AllocationValidationError(
                f"{context}: ffn p{fpp} differs from attn p{pp}; the expert and attention "
                f"layers share the pipeline stages: give ffn p{pp} or leave p out of ffn"
            )
        fdp = f.get("data_parallel_size")
        if fdp is None:
            non_dp = ep * etp * pp
            if attn_world % non_dp:
                raise AllocationValidationError(
                    f"{context}: cannot derive ffn d: the attn world size {attn_world} "
                    f"(d{dp}*t{tp}*p{pp}*c{cp}) is not divisible by ffn e*t*p = {non_dp}"
                )
            fdp = attn_world // non_dp
        ffn_world = fdp * ep * etp * pp
        if ffn_world != attn_world:
            raise AllocationValidationError(
                f"{context}: the world sizes of the two halves differ: attn d{dp}*t{tp}*p{pp}"
                f"*c{cp} = {attn_world}, ffn d{fdp}*e{ep}*t{etp}*p{pp} = {ffn_world}; they "
                "must be equal (both layouts cover the same ranks)"
            )
        return cls(
            data_parallel_size=dp,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            context_parallel_size=cp,
            expert_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            hybrid_moe=True,
        )

    @staticmethod
    def parse_backend(spec: str, field_name: str = "backend") -> ModelAllocation:
        """Parse a per-engine ``backend`` field such as ``'fsdp:d2'`` or ``'vllm:d2t2'``."""
        if "+" in spec or ("|" in spec and _HYBRID_RE.search(spec.split(":", 1)[-1]) is None):
            raise InvalidAllocationModeError(
                f"{field_name}={spec!r}: a per-engine backend is one component like 'fsdp:d4' or "
                "'vllm:d2t2'; '+' and '|' belong in allocation_mode"
            )
        alloc = ModelAllocation.from_str(spec, context=f"{field_name}={spec!r}")
        if alloc.backend is None:
            raise InvalidAllocationModeError(
                f"{field_name}={spec!r}: needs an explicit backend prefix, one of "
                f"{list(INFERENCE_BACKENDS + TRAIN_BACKENDS)}, e.g. 'fsdp:{spec}'"
            )
        return alloc


@dataclass
class FSDPParallelStrategy(ParallelStrategy):
    """AReaL's name for the parallel sizes of an FSDP component (same fields)."""


@dataclass
class ModelAllocation:
    """One component: backend, optional name, parallel sizes, scheduling (AReaL's fields).

    ``scheduling_strategy`` is a ``SchedulingStrategy`` (``type`` separation|colocation,
    ``target``) or ``None`` (separation); a colocated component needs no devices of its
    own, so its ``world_size`` is 0 as in AReaL.
    """

    backend: str | None
    name: str | None = None
    parallel: ParallelStrategy = field(default_factory=ParallelStrategy)
    scheduling_strategy: SchedulingStrategy | None = None

    @property
    def is_inference(self) -> bool:
        return self.backend in INFERENCE_BACKENDS

    @property
    def world_size(self) -> int:
        strategy = self.scheduling_strategy
        if strategy is not None and strategy.type == "colocation":
            return 0
        return self.parallel.world_size

    @classmethod
    def from_str(
        cls,
        spec: str,
        name: str | None = None,
        scheduling_strategy: SchedulingStrategy | None = None,
        *,
        context: str | None = None,
    ) -> ModelAllocation:
        """``'vllm:d2t2'``, ``'fsdp[actor]:d4'``, ``'sglang.d4'`` or bare ``'d4'`` (backend None).

        As AReaL: ``name`` (e.g. ``"rollout"``) overrides a name in the spec, and
        ``scheduling_strategy`` is attached as given (``None``: separation); a spec with
        ``'+'`` (several components) is refused: parse it with ``AllocationMode``.
        """
        context = context or f"allocation component {spec!r}"
        if "+" in spec:
            raise InvalidAllocationModeError(
                f"{context}: ModelAllocation.from_str takes one component; split "
                "'a+b' into per-engine backend fields (actor.backend='fsdp:d4', "
                "rollout.backend='sglang:d4') or use AllocationMode.from_str"
            )
        alloc = cls._parse(spec, context)
        if name is not None:
            alloc.name = name
        alloc.scheduling_strategy = scheduling_strategy
        return alloc

    @classmethod
    def _parse(cls, spec: str, context: str) -> ModelAllocation:
        spec = spec.strip()
        if not spec:
            raise InvalidAllocationModeError(f"{context}: empty component")
        m = _COMPONENT_RE.match(spec)
        if m is None or m.group("backend").lower() == "attn":  # bare dims / bare hybrid form
            return cls(backend=None, parallel=ParallelStrategy.from_dims(spec, context=context))
        backend = m.group("backend").lower()
        allowed = INFERENCE_BACKENDS + TRAIN_BACKENDS
        if backend not in allowed:
            raise InvalidAllocationModeError(
                f"{context}: unknown backend {backend!r}; allowed: {list(allowed)}"
            )
        name = m.group("name1") or m.group("name2")
        parallel = ParallelStrategy.from_dims(m.group("dims"), context=context)
        if backend in TRAIN_BACKENDS:
            backend = map_train_backend(backend, parallel, context)
        check_train_dims(backend, parallel, context)
        return cls(backend=backend, parallel=parallel, name=name)

    def __str__(self) -> str:
        head = self.backend or "fsdp"
        if self.name:
            head += f"[{self.name}]"
        return f"{head}:{self.parallel}"


@dataclass
class AllocationMode:
    """Parsed allocation mode. Build it with :meth:`from_str`."""

    type_: AllocationType
    allocations: list[ModelAllocation] = field(default_factory=list)
    source: str = ""

    @classmethod
    def from_str(cls, allocation_mode: str) -> AllocationMode:
        """Parse an allocation string (see the module docstring); ValueError when malformed."""
        if not isinstance(allocation_mode, str) or not allocation_mode.strip():
            raise InvalidAllocationModeError(
                f"allocation_mode={allocation_mode!r} is empty; expected e.g. 'local:d1+fsdp:d2'"
            )
        text = allocation_mode.strip()
        context = f"allocation_mode={text!r}"
        parts, sep = _split_components(text, context)
        allocs = [ModelAllocation.from_str(p, context=context) for p in parts]
        gens = [a for a in allocs if a.is_inference]
        trains = [a for a in allocs if not a.is_inference]
        for a in trains:
            if a.backend is None:
                a.backend = map_train_backend("fsdp", a.parallel, context)
                check_train_dims(a.backend, a.parallel, context)
        if len(gens) > 1:
            raise AllocationValidationError(
                f"{context}: {len(gens)} inference components; at most one of {list(INFERENCE_BACKENDS)} is allowed"
            )
        if len(trains) > 1:
            names = [a.name for a in trains]
            if None in names or len(set(names)) != len(names):
                raise AllocationValidationError(
                    f"{context}: several training components need distinct names, e.g. 'fsdp[actor]:d4+fsdp[critic]:d4'"
                )
        if sep == "|" and not (gens and trains):
            raise AllocationValidationError(
                f"{context}: '|' (colocation) needs one inference and one training component"
            )
        if gens and trains:
            type_ = AllocationType.COLOCATE if sep == "|" else AllocationType.DECOUPLED_TRAIN
        elif gens:
            type_ = AllocationType.LLM_SERVER_ONLY
        else:
            type_ = AllocationType.COLOCATE
        if type_ is AllocationType.COLOCATE and gens and gens[0].world_size != trains[0].world_size:
            raise AllocationValidationError(
                f"{context}: colocated components must use the same number of devices "
                f"(inference {gens[0].world_size}, training {trains[0].world_size})"
            )
        return cls(type_=type_, allocations=allocs, source=text)

    # ---- component access
    def _gen_alloc(self) -> ModelAllocation | None:
        return next((a for a in self.allocations if a.is_inference), None)

    def _train_alloc(self) -> ModelAllocation | None:
        return next((a for a in self.allocations if not a.is_inference), None)

    def __getitem__(self, name: str) -> ModelAllocation:
        for a in self.allocations:
            if a.name == name:
                return a
        names = [a.name for a in self.allocations if a.name]
        raise KeyError(f"No allocation component named {name!r}; named components: {names}")

    @property
    def gen(self) -> ParallelStrategy | None:
        """Parallel sizes of the inference component (None when there is none)."""
        a = self._gen_alloc()
        return a.parallel if a else None

    @property
    def train(self) -> ParallelStrategy | None:
        """Parallel sizes of the (first) training component (None when there is none)."""
        a = self._train_alloc()
        return a.parallel if a else None

    @property
    def gen_backend(self) -> str | None:
        a = self._gen_alloc()
        return a.backend if a else None

    @property
    def train_backend(self) -> str | None:
        a = self._train_alloc()
        return a.backend if a else None

    @property
    def gen_world_size(self) -> int:
        """Devices used by inference servers (0 without inference)."""
        return self.gen.world_size if self.gen else 0

    @property
    def train_world_size(self) -> int:
        """Training processes (world size of the first training component; 0 without training)."""
        return self.train.world_size if self.train else 0

    @property
    def gen_instance_size(self) -> int:
        """Devices of one inference server instance: tp * pp."""
        return self.gen.tp_size * self.gen.pp_size if self.gen else 0

    @property
    def gen_n_instances(self) -> int:
        """Number of inference server instances (the inference data-parallel size)."""
        return self.gen.dp_size if self.gen else 0

    @property
    def world_size(self) -> int:
        """Devices needed in total: colocated components share, decoupled ones add up."""
        sizes = [a.world_size for a in self.allocations]
        if self.type_ is AllocationType.COLOCATE:
            return max(sizes)
        return sum(sizes)

    def __str__(self) -> str:
        sep = "|" if self.type_ is AllocationType.COLOCATE and self.gen is not None else "+"
        return sep.join(str(a) for a in self.allocations)
