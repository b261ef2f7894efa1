"""Configuration dataclasses (placeholder: the config helper expands this module).

Only ``GenerationHyperparameters`` is final here; other sections are being written.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class GenerationHyperparameters:
    """Sampling parameters for one generation request."""

    n_samples: int = field(default=1, metadata={"help": "Number of sequences sampled per prompt."})
    max_new_tokens: int = field(default=16384, metadata={"help": "Maximum number of generated tokens."})
    min_new_tokens: int = field(default=0, metadata={"help": "Minimum number of generated tokens before a stop is allowed."})
    max_tokens: int = field(default=65536, metadata={"help": "Maximum prompt + generated tokens."})
    greedy: bool = field(default=False, metadata={"help": "Greedy decoding (argmax) instead of sampling."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling probability mass, in (0, 1]."})
    top_k: int = field(default=int(1e8), metadata={"help": "Keep only the k most likely tokens when sampling."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature; > 0."})
    stop_token_ids: list[int] = field(default_factory=list, metadata={"help": "Token ids that end generation (EOS is always added by the engine)."})
    ignore_eos: bool = field(default=False, metadata={"help": "Keep generating after EOS."})
    skip_special_tokens: bool = field(default=True, metadata={"help": "Skip special tokens when decoding text."})
    stop: list[str] | None = field(default=None, metadata={"help": "Stop strings."})
    frequency_penalty: float = field(default=0.0, metadata={"help": "Frequency penalty (accepted; the built-in server ignores it)."})

    def __post_init__(self):
        if self.n_samples < 1:
            raise ValueError(f"gconfig.n_samples={self.n_samples}; must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"gconfig.max_new_tokens={self.max_new_tokens}; must be >= 1")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"gconfig.min_new_tokens={self.min_new_tokens}; must be in [0, max_new_tokens={self.max_new_tokens}]"
            )
        if not self.temperature > 0:
            raise ValueError(f"gconfig.temperature={self.temperature}; must be > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"gconfig.top_p={self.top_p}; must be in (0, 1]")
        if self.top_k < 1:
            raise ValueError(f"gconfig.top_k={self.top_k}; must be >= 1")

    def new(self, **kwargs) -> GenerationHyperparameters:
        """Copy with some fields changed, e.g. ``gconfig.new(temperature=0.6)``."""
        d = asdict(self)
        unknown = set(kwargs) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"GenerationHyperparameters has no field(s) {sorted(unknown)}")
        d.update(kwargs)
        return GenerationHyperparameters(**d)
