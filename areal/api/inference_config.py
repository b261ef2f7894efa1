"""Inference configs: sampling (``GenerationHyperparameters``), vLLM / SGLang server arguments and commands, agent workflows, ``InferenceEngineConfig`` (rollout).

Re-exported by ``areal.api.cli_args``; import from there or from here.
"""

from __future__ import annotations

from dataclasses import MISSING as _DC_MISSING
from dataclasses import asdict, dataclass, fields
from typing import Any

from areal.api.config_common import (
    NOT_ACTED,
    cfield,
    check_choice,
    check_range,
    logger,
    warn_once,
)
from areal.api.engine_config import SchedulingSpec, SchedulingStrategy, default_scheduling_spec


@dataclass
class GenerationHyperparameters:
    """Sampling parameters for one generation request."""

    n_samples: int = cfield(1, "Number of sequences sampled per prompt (the GRPO group size).")
    max_new_tokens: int = cfield(16384, "Maximum number of generated tokens.")
    min_new_tokens: int = cfield(0, "Minimum number of generated tokens before a stop is allowed.")
    max_tokens: int = cfield(32768, "Maximum prompt + generated tokens.")
    greedy: bool = cfield(False, "Greedy decoding (argmax) instead of sampling.")
    top_p: float = cfield(1.0, "Nucleus sampling probability mass, in (0, 1].")
    top_k: int = cfield(int(1e8), "Keep only the k most likely tokens when sampling.")
    temperature: float = cfield(1.0, "Sampling temperature; > 0.")
    stop_token_ids: list[int] = cfield(
        help="Token ids that end generation (EOS is always added by the engine).", factory=list
    )
    ignore_eos: bool = cfield(False, "Keep generating after EOS.")
    skip_special_tokens: bool = cfield(True, "Skip special tokens when decoding text.")
    stop: list[str] | None = cfield(None, "Stop strings.")
    frequency_penalty: float = cfield(
        0.0, "Frequency penalty (accepted; the built-in server ignores it)."
    )
    lora_name: str = cfield(
        "default_lora", "Name of the LoRA adapter used for this request. " + NOT_ACTED
    )
    use_beam_search: bool = cfield(False, "Beam search (vLLM only). " + NOT_ACTED)
    seed: int | None = cfield(
        None,
        "Sampling seed sent with every request (all members of a group then sample the "
        "same stream). None: each request gets its own stable seed derived from the "
        "experiment seed and the request's identity.",
    )
    reward_normalization: bool = cfield(
        False,
        "Normalise each group's rewards at rollout time, (r - mean) / (std + 1e-8) over its "
        "n_samples members (a group with a missing member is dropped); the raw reward is "
        "kept as original_rewards.",
    )
    drop_incomplete_group: bool = cfield(
        False,
        "Drop a whole group when any of its n_samples rollouts fails or returns None "
        "(another prompt takes its place); False keeps the members that finished.",
    )

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

    def new_with_stop_and_pad_token_ids(self, tokenizer: Any) -> GenerationHyperparameters:
        """Copy whose ``stop_token_ids`` also hold the tokenizer's pad and EOS ids.

        Ids already present are not repeated; a tokenizer without a pad (or EOS) token
        (id ``None``) adds nothing for it.
        """
        stop_ids = list(self.stop_token_ids)
        for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
            if token_id is not None and token_id not in stop_ids:
                stop_ids.append(token_id)
        return self.new(stop_token_ids=stop_ids)

    def to_openai_args_dict(
        self, exclude_args: list[str] | None = None, api_format: str = "completions"
    ) -> dict[str, Any]:
        """Keyword arguments for an OpenAI-style client call.

        ``api_format``: 'completions' (``max_new_tokens`` -> ``max_completion_tokens``),
        'responses' (-> ``max_output_tokens``) or 'openai-agents' (-> ``max_tokens``);
        ``n_samples`` becomes ``n``. Fields OpenAI has no argument for
        (``OPENAI_UNSUPPORTED_GCONFIG_ARGS``) and those in ``exclude_args`` are left out,
        with a warning when they differ from their default.
        """
        renamed = {"n_samples": "n"}
        max_new_key = _OPENAI_MAX_NEW_TOKENS_KEY.get(api_format)
        if max_new_key is None:
            raise ValueError(
                f"api_format={api_format!r} is not allowed; choose one of "
                f"{list(_OPENAI_MAX_NEW_TOKENS_KEY)}"
            )
        renamed["max_new_tokens"] = max_new_key
        excluded = set(exclude_args or ()) | OPENAI_UNSUPPORTED_GCONFIG_ARGS
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "seed" and value is None:
                continue  # no fixed seed: the request's own
            if f.name in excluded:
                default = f.default if f.default is not _DC_MISSING else f.default_factory()
                if value != default:
                    logger.warning(
                        f"gconfig.{f.name}={value!r} has no OpenAI {api_format} argument; "
                        "it is not sent"
                    )
                continue
            key = renamed.get(f.name, f.name)
            if key in out:
                logger.warning(f"OpenAI argument {key!r} from gconfig.{f.name} overrides another")
            out[key] = list(value) if isinstance(value, list) else value
        return out

    def to_openai_completions_args_dict(
        self, exclude_args: list[str] | None = None
    ) -> dict[str, Any]:
        """``to_openai_args_dict(exclude_args, api_format='completions')``."""
        return self.to_openai_args_dict(exclude_args=exclude_args, api_format="completions")

    def to_openai_responses_args_dict(
        self, exclude_args: list[str] | None = None
    ) -> dict[str, Any]:
        """``to_openai_args_dict(exclude_args, api_format='responses')``."""
        return self.to_openai_args_dict(exclude_args=exclude_args, api_format="responses")

    def to_openai_agents_model_settings_dict(
        self, exclude_args: list[str] | None = None
    ) -> dict[str, Any]:
        """``to_openai_args_dict(exclude_args, api_format='openai-agents')``."""
        return self.to_openai_args_dict(exclude_args=exclude_args, api_format="openai-agents")


# Generation fields with no OpenAI-API argument (left out by to_openai_args_dict).
OPENAI_UNSUPPORTED_GCONFIG_ARGS = frozenset(
    {
        "min_new_tokens",
        "greedy",
        "top_k",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "lora_name",
        "use_beam_search",
        "max_tokens",
        # workflow-level options (AReaL 2.0's _WORKFLOW_ONLY_ARGS), not request arguments
        "reward_normalization",
        "drop_incomplete_group",
    }
)


_OPENAI_MAX_NEW_TOKENS_KEY = {
    "completions": "max_completion_tokens",
    "responses": "max_output_tokens",
    "openai-agents": "max_tokens",
}


def _default_agent_scheduling_spec() -> list[SchedulingSpec]:
    return [SchedulingSpec(cpu=1, gpu=0, mem=4)]


_AGENT_MODES = ["inline", "subproc", "online"]


@dataclass
class AgentConfig:
    """Agent workflows: the OpenAI-compatible proxy they talk to and the agent service.

    Holds what AReaL's earlier ``rollout.openai`` (OpenAIProxyConfig) section held, plus
    the agent class and the agent-service workers.
    """

    agent_cls_path: str = cfield(
        "", "Import path ('pkg.module.Class') of the agent implementation; empty: none."
    )
    admin_api_key: str = cfield(
        "areal-admin-key",
        "Admin key of the proxy and agent service (management calls only; each session "
        "gets its own key). Change it for anything beyond localhost.",
    )
    scheduling_spec: list[SchedulingSpec] = cfield(
        help="Resources of the agent-service worker; exactly one spec.",
        factory=_default_agent_scheduling_spec,
    )
    mode: str = cfield(
        "inline",
        "'inline' (agent runs in the rollout process), 'subproc' (in a worker process "
        "pool) or 'online' (external users drive sessions through the proxy).",
        choices=_AGENT_MODES,
    )
    tool_call_parser: str = cfield("qwen", "Parser of tool calls in model output.")
    reasoning_parser: str = cfield("qwen3", "Parser of reasoning content (<think> tags).")
    chat_template_type: str = cfield(
        "hf",
        "'hf' (the tokenizer's chat template) or 'concat' (multi-turn concatenation).",
        choices=["hf", "concat"],
    )
    engine_max_tokens: int | None = cfield(
        None, "Maximum prompt + completion tokens of one call; None: no limit."
    )
    turn_discount: float = cfield(1.0, "Reward discount per turn of a multi-turn episode.")
    export_style: str = cfield(
        "individual",
        "'individual': every interaction is a training sample; 'concat': only the final "
        "concatenated conversation (linear histories only).",
        choices=["individual", "concat"],
    )
    subproc_max_workers: int = cfield(4, "Worker processes in 'subproc' mode; >= 1.")
    session_timeout_seconds: int = cfield(3600, "Sessions idle longer than this are dropped; > 0.")
    set_reward_finish_timeout: float = cfield(
        0.0, "Seconds to wait for further reward updates before a session is final; >= 0."
    )
    proxy_host: str = cfield(
        "127.0.0.1",
        "Address the trainer's OpenAI-compatible proxy binds to; '0.0.0.0' exposes it "
        "(online mode with clients on other machines: change admin_api_key too).",
    )
    proxy_port: int = cfield(0, "Port of the trainer's proxy; 0 = a free port (logged); >= 0.")
    proxy_workers: int = cfield(
        0,
        "0: one proxy inside the trainer process. N >= 1: N proxy worker processes "
        "(scheduler role 'proxy') behind one session-affine gateway at "
        "proxy_host:proxy_port (every call of a session on one worker; a dead worker's "
        "open sessions fail with an error, new ones go to the live workers); >= 0.",
    )
    message_preprocessors: list[str] = cfield(
        help="Import paths of preprocessors of Anthropic-style /v1/messages requests "
        "(AReaL 2.0's agent service). " + NOT_ACTED,
        factory=list,
    )
    prefix_matcher: str | None = cfield(
        None,
        "Import path of a custom parent/child prefix matcher of the interaction cache. "
        + NOT_ACTED,
    )
    drop_retry_orphans: bool = cfield(
        False, "Drop completions an agent SDK retried before export. " + NOT_ACTED
    )

    def __post_init__(self):
        owner = "AgentConfig"
        check_choice(owner, "mode", self.mode, _AGENT_MODES)
        check_choice(owner, "chat_template_type", self.chat_template_type, ["hf", "concat"])
        check_choice(owner, "export_style", self.export_style, ["individual", "concat"])
        if len(self.scheduling_spec) != 1:
            raise ValueError(
                f"{owner}.scheduling_spec has {len(self.scheduling_spec)} entries; must have exactly 1"
            )
        if not self.admin_api_key or not self.admin_api_key.strip():
            raise ValueError(f"{owner}.admin_api_key is empty; it must be a non-blank string")
        check_range(owner, "subproc_max_workers", self.subproc_max_workers, ge=1)
        check_range(owner, "session_timeout_seconds", self.session_timeout_seconds, gt=0)
        check_range(owner, "set_reward_finish_timeout", self.set_reward_finish_timeout, ge=0)
        check_range(owner, "engine_max_tokens", self.engine_max_tokens, ge=1, optional=True)
        check_range(owner, "proxy_port", self.proxy_port, ge=0)
        check_range(owner, "proxy_workers", self.proxy_workers, ge=0)
        if not self.proxy_host or not self.proxy_host.strip():
            raise ValueError(f"{owner}.proxy_host is empty; give an address such as '127.0.0.1'")


# Earlier AReaL name of the proxy section (rollout.openai); its fields are AgentConfig's.
OpenAIProxyConfig = AgentConfig


@dataclass
class InferenceEngineConfig:
    """Rollout: inference servers, request policy and staleness control."""

    experiment_name: str | None = cfield(
        None, "Experiment name; defaults to the top-level experiment_name."
    )
    trial_name: str | None = cfield(None, "Trial name; defaults to the top-level trial_name.")
    backend: str = cfield(
        "",
        "Inference backend and parallel sizes, e.g. 'local:d1', 'vllm:d2t2', 'sglang:d4'. "
        "Empty: taken from the top-level allocation_mode.",
    )
    max_concurrent_rollouts: int | None = cfield(
        None, "Maximum rollouts in flight at once; None: consumer_batch_size; >= 1."
    )
    queue_size: int | None = cfield(
        None, "Capacity of the input/output rollout queues; None: unbounded-ish default; >= 1."
    )
    consumer_batch_size: int = cfield(
        1, "Trajectories the trainer takes per step (usually ${train_dataset.batch_size}); >= 1."
    )
    max_head_offpolicyness: int = cfield(
        0,
        "Maximum staleness: a rollout may start only while its policy version is at most "
        "this many versions behind the trainer; 0 = synchronous RL; >= 0.",
    )
    enable_rollout_tracing: bool = cfield(False, "Log every generation request verbosely.")
    check_trajectory_format: bool = cfield(
        False, "Check the tensors each workflow returns (for debugging workflows)."
    )
    schedule_policy: str = cfield(
        "round_robin", "How requests are spread over servers.", choices=["round_robin"]
    )
    fileroot: str | None = cfield(
        None, "Root directory of trajectory dumps (usually ${cluster.fileroot})."
    )
    tokenizer_path: str = cfield("", "Tokenizer used to decode dumped trajectories.")
    dump_to_file: bool = cfield(False, "Dump every trajectory as text under fileroot.")
    setup_timeout: float = cfield(300.0, "Seconds to wait for servers to become healthy; > 0.")
    request_timeout: float = cfield(
        3600, "Seconds before an HTTP generation request times out; > 0."
    )
    request_retries: int = cfield(3, "Retries of a failed request; >= 0.")
    health_check_interval: float = cfield(
        5.0,
        "Seconds between health probes of each inference server (a background thread of "
        "RemoteInfEngine); 0 = no probes (a hung server is then only noticed when a request "
        "times out); >= 0.",
    )
    health_check_timeout: float = cfield(
        30.0,
        "A server that answers no health probe and no request for this many seconds is "
        "declared hung: taken out of rotation, its in-flight requests move to the other "
        "servers and the ServerWatchdog kills and restarts it; > 0.",
    )
    pause_grace_period: float = cfield(
        0.0, "Seconds to wait after pausing servers before weights are updated; >= 0."
    )
    cpu_thread_handoff: bool = cfield(
        False,
        "CPU, built-in servers on loopback: while the trainer waits for a batch or "
        "evaluates, the servers get its idle cores (CPUs / servers threads each), then "
        "go back to one thread. No effect on CUDA, remote hosts, vLLM or SGLang.",
    )
    inflight_weight_updates: bool = cfield(
        True,
        "Built-in server: a full-weight update (disk or xccl) does not pause generation: "
        "the new weights are staged beside the live ones and swapped in between two decode "
        "steps at commit; running requests go on with them (later tokens carry the new "
        "version, the decoupled loss corrects). False, LoRA, vLLM, SGLang: pause and resume.",
    )
    verify_weights: bool = cfield(
        True,
        "After every weight update, compare a fingerprint of each server's weights with the "
        "trainer's and fail naming server and tensor on a mismatch (built-in server; "
        "areal.infra.weight_verify): a strided sample of every tensor at every update, the "
        "row sums of every element on a rotation (verify_weights_full_every).",
    )
    verify_weights_full_every: int = cfield(
        8,
        "The row sums (every element counts) of each tensor are checked once every this many "
        "weight updates, a share of about 1/N of the weights at each; 1 = every tensor in "
        "full at every update (costs about one extra read of the weights on each side); >= 1.",
    )
    verify_weights_background: bool = cfield(
        True,
        "The trainer digests its disk exports of 32 MiB or more on a thread while the servers "
        "load (the check still runs inside the sync and the new version is committed only "
        "after it passed). False: the digests are taken during the export.",
    )
    verify_weights_in_response: bool = cfield(
        True,
        "Disk updates carry the fingerprints: the trainer writes its reference next to the "
        "weights and built-in servers return theirs in the update answer, compared with no "
        "extra request (both sides' digests on the sync's path, the trainer's on a thread "
        "for exports of 32 MiB or more with verify_weights_background: ~3% of a sync on the "
        "demo model, docs/fault_tolerance.md). False: the trainer and the servers are asked "
        "after the push, with requests.",
    )
    max_consecutive_weight_sync_refusals: int | None = cfield(
        3,
        "A refused weight sync (a weight check failed, or a push failed on a server) rolls "
        "every server back to the previous weights and version and the run continues on "
        "them, retrying at the next step (counted in weight_sync/refusals); after this many "
        "refusals in a row the run stops with an error naming the version, the server and "
        "the tensor. 0: stop at the first refusal; null: never stop; >= 0.",
    )
    max_consecutive_episode_failures: int | None = cfield(
        64,
        "The run stops with RolloutFailureError (quoting the most common failure and how "
        "often it occurred) when this many episodes in a row failed: the workflow raised "
        "(its own exception, or an HTTP error of a server, e.g. 400 for a prompt longer than "
        "the context), returned a malformed trajectory, or the accept filter raised. "
        "Rejections (a workflow returning None, dynamic-sampling filtering, stale results) "
        "are not failures. The same for evaluation episodes. null: never stop for this; >= 1.",
    )
    max_consecutive_rejections: int | None = cfield(
        1024,
        "The run stops with RolloutFailureError when this many finished training episodes "
        "(groups, with n_samples > 1) in a row were rejected and gave nothing, with none "
        "accepted between: filtered out by the accept filter (dynamic sampling drops a group "
        "whose rewards are all equal) or returned None by the workflow. Without it such a "
        "run waits forever for a batch that never fills. Stale results are not counted "
        "(their rows are generated again). null: never stop for this; >= 1.",
    )
    max_num_gen_batches: int | None = cfield(
        4,
        "Bound on what one training step generates while a filter drops groups (dynamic "
        "sampling; verl's algorithm.filter_groups.max_num_gen_batches): once the groups a "
        "step finished reach this many batches with fewer than a batch accepted, the step "
        "trains on the accepted groups plus the newest filtered ones (within "
        "max_head_offpolicyness) to fill the batch (with GRPO's group-normalised "
        "advantages they add no gradient, as without the filter; the batch keeps its "
        "size) and logs a WARNING: the share of all-equal groups (all zero / all max), of "
        "truncated samples, what to change (rollout/gen_bound_hit). Smaller only when too "
        "few filtered groups were kept (None results). Not with deterministic: true. "
        "null: no bound (verl's 0); >= 1.",
    )
    max_episode_failure_ratio: float | None = cfield(
        0.5,
        "The run stops (RolloutFailureError) when more than this share of the last "
        "episode_failure_window finished episodes failed (checked once that many "
        "finished); occasional failures are counted in rollout/n_failed. null: never stop "
        "for this; in (0, 1].",
    )
    episode_failure_window: int = cfield(
        256, "Finished episodes over which max_episode_failure_ratio is measured; >= 1."
    )
    generation_api_key_env: str = cfield(
        "",
        "Name of a controller environment variable holding an API key the built-in servers "
        "then require on their generation endpoints (handed over as AREAL_SERVER_API_KEY in "
        "the environment, never on a command line); empty: generation endpoints open.",
    )
    scheduling_spec: list[SchedulingSpec] = cfield(
        help="Worker resources of the rollout role (single-controller schedulers).",
        factory=default_scheduling_spec,
    )
    scheduling_strategy: SchedulingStrategy = cfield(
        help="Own workers ('separation') or another role's ('colocation').",
        factory=SchedulingStrategy,
    )
    use_lora: bool = cfield(False, "Serve LoRA adapters. " + NOT_ACTED)
    agent: AgentConfig = cfield(
        help="Agent workflows: OpenAI-compatible proxy and agent service.", factory=AgentConfig
    )
    openai: AgentConfig | None = cfield(
        None,
        "DEPRECATED (AReaL's earlier name of `agent`): moved into rollout.agent with a warning.",
    )
    return_routed_experts: bool = cfield(
        False,
        "Ask the inference servers (built-in, SGLang) for the experts each token was routed "
        "to; RLVR and multi-turn workflows put them in the batch as 'routed_experts' for "
        "the Archon engine's routing replay (actor.archon.router_replay). Refused for vLLM.",
    )
    deterministic: bool = cfield(
        False,
        "Reproducible rollout (set by the experiment's top-level `deterministic`): waves of "
        "exactly one batch, each served by weight version max(0, k - max_head_offpolicyness), "
        "consumed in submission order, seeds from the dataset position, and built-in server "
        "requests computed one per forward (docs/best_practices/reproducibility.md).",
    )
    _version: str = cfield(
        "v1",
        "AReaL's rollout-controller version: 'v1' or 'v2' (AReaL's inference-service "
        "gateway). Here one controller serves both; 'v2' only changes the agent proxy as "
        "2.0's v2 gateway behaves: /rl/start_session answers HTTP 201 and the proxy's admin "
        "key is admin_api_key (not agent.admin_api_key).",
        choices=["v1", "v2"],
    )
    model: str = cfield("default", "Model name exposed by the gateway (v2). " + NOT_ACTED)
    routing_strategy: str = cfield("round_robin", "Gateway routing (v2). " + NOT_ACTED)
    poll_interval: float = cfield(5.0, "Gateway health-poll seconds (v2). " + NOT_ACTED)
    admin_api_key: str = cfield(
        "areal-admin-key",
        "Gateway admin key (v2): with _version='v2', the agent proxy's admin key.",
    )
    api_url: str | None = cfield(
        None, "External OpenAI-compatible base URL (v2 external model). " + NOT_ACTED
    )
    provider_api_key: str | None = cfield(
        None, "API key of the external provider (v2). " + NOT_ACTED
    )
    deterministic_sampling: bool = cfield(
        False,
        "AReaL 2.0's name for reproducible rollouts (stable request seeds, canonical group "
        "and result order): sets the experiment's `deterministic` (this project's mode, "
        "which needs the built-in server).",
    )
    serialize_group_samples: bool = cfield(
        False,
        "Run the n_samples members of a group one after another instead of concurrently "
        "(stable submission order within the group, less generation throughput).",
    )
    workers_ready_timeout: float = cfield(
        30.0, "Seconds initialize() waits for AReaL's v2 guard processes. " + NOT_ACTED
    )
    lora_name: str = cfield(
        "",
        "LoRA adapter name the rollout servers serve (usually filled in from the actor's "
        "LoRA settings). " + NOT_ACTED,
    )

    def __post_init__(self):
        owner = "InferenceEngineConfig"
        if self.openai is not None:
            if self.agent != AgentConfig() and self.agent != self.openai:
                raise ValueError(
                    f"{owner}: both the deprecated `openai` section and `agent` are set and "
                    "disagree; keep only `agent`"
                )
            self.agent = self.openai
            warn_once(
                "rollout-openai",
                "rollout.openai is deprecated; its settings were moved to rollout.agent. "
                "Rename the section to `agent`.",
            )
        check_range(
            owner, "max_concurrent_rollouts", self.max_concurrent_rollouts, ge=1, optional=True
        )
        check_range(owner, "queue_size", self.queue_size, ge=1, optional=True)
        check_range(owner, "consumer_batch_size", self.consumer_batch_size, ge=1)
        if not isinstance(self.deterministic, bool):
            raise ValueError(
                f"{owner}.deterministic={self.deterministic!r}; allowed: true or false"
            )
        check_range(owner, "max_head_offpolicyness", self.max_head_offpolicyness, ge=0)
        check_choice(owner, "schedule_policy", self.schedule_policy, ["round_robin"])
        check_range(owner, "setup_timeout", self.setup_timeout, gt=0)
        check_range(owner, "request_timeout", self.request_timeout, gt=0)
        check_range(owner, "request_retries", self.request_retries, ge=0)
        check_range(owner, "health_check_interval", self.health_check_interval, ge=0)
        check_range(owner, "health_check_timeout", self.health_check_timeout, gt=0)
        check_range(owner, "pause_grace_period", self.pause_grace_period, ge=0)
        check_range(owner, "verify_weights_full_every", self.verify_weights_full_every, ge=1)
        for name, lowest in (
            ("max_consecutive_weight_sync_refusals", 0),
            ("max_consecutive_episode_failures", 1),
            ("max_consecutive_rejections", 1),
            ("max_num_gen_batches", 1),
        ):
            check_range(owner, name, getattr(self, name), ge=lowest, optional=True)
        check_range(
            owner,
            "max_episode_failure_ratio",
            self.max_episode_failure_ratio,
            gt=0,
            le=1,
            optional=True,
        )
        check_range(owner, "episode_failure_window", self.episode_failure_window, ge=1)
        if len(self.scheduling_spec) not in (1, 2):
            raise ValueError(
                f"{owner}.scheduling_spec has {len(self.scheduling_spec)} entries; must have 1 or 2"
            )
        if self.backend:
            from areal.api.alloc_mode import ParallelStrategy

            ParallelStrategy.parse_backend(self.backend, field_name=f"{owner}.backend")
