"""Settings of one simulated SGLang engine.

Defaults model GLM-5.3 on one 8xH200 server with DP attention over 8 ranks and
an FP8 KV cache; docs/simulator.md explains where each number comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ramjet.sim.kv_wire import FORMATS, KVEventsConfig, parse_config, tcp_port

VERSION = "0.5.20"
FAULT_MODES = ("none", "wedge", "error", "slow")
SLOW_FACTOR = 10.0


@dataclass(frozen=True)
class SimConfig:
    dp_size: int = 8
    model_name: str = "glm-5.3"
    api_key: str | None = None
    kv_tokens_per_rank: int = 193_000
    page_tokens: int = 64
    hicache_tokens_per_rank: int = 0
    prefill_tokens_per_s: float = 6_500.0
    hicache_load_tokens_per_s: float = 95_000.0
    decode_tokens_per_s: float = 180.0  # one request's decode speed with no context (fitted, docs/simulator.md)
    max_running_per_rank: int = 16
    chunked_prefill: int = 32_768  # SGLang's --chunked-prefill-size: with DP attention each rank gets 1/dp_size of it
    prefill_decode_share: float = 0.5  # decode speed every rank keeps while any rank prefills (fitted)
    decode_context_tokens: int = 20_000  # a rank decodes 1 + (its running requests' context) / this times slower
    time_scale: float = 1.0
    idle_keepalive_s: float = 5.0
    health_generation: bool = True  # SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION
    health_timeout_s: float = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT, real seconds
    ideal_max_pages: int = 1_000_000
    faults: dict[int, str] = field(default_factory=dict)
    # test hooks for a balancer's hardening: headers added to every answer (a hostile or misconfigured engine),
    # and a text that makes every rank answer 500 (an input the engine cannot handle: a "query of death")
    response_headers: dict[str, str] = field(default_factory=dict)
    poison_text: str | None = None
    tokenizer_dir: str | None = None  # a Hugging Face tokenizer directory; None: the shipped one
    kv_events_config: str | None = None  # --kv-events-config, the JSON as given
    kv_events_format: str = "sglang"  # whose wire format the events follow
    load_publish_endpoint: str | None = None  # SGLang's --load-publish-endpoint: auto, off or tcp://HOST:PORT

    def __post_init__(self) -> None:
        problems = []
        if self.kv_events_format not in FORMATS:
            problems.append(f"kv_events_format must be one of {', '.join(FORMATS)}")
        else:
            try:
                events = self.kv_events()
            except ValueError as e:
                problems.append(str(e))
                events = None
            load = self.load_publish_endpoint
            if load not in (None, "off"):
                if self.kv_events_format != "sglang" or events is None:
                    problems.append("--load-publish-endpoint needs SGLang-format KV events (--kv-events-config)")
                elif load != "auto" and tcp_port(load) is None:
                    problems.append("--load-publish-endpoint must be auto, off or tcp://HOST:PORT")
        for name in ("dp_size", "kv_tokens_per_rank", "page_tokens", "max_running_per_rank",
                     "chunked_prefill", "ideal_max_pages"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if not 0 < self.prefill_decode_share <= 1:
            problems.append("prefill_decode_share must be in (0, 1]")
        if self.decode_context_tokens < 0:
            problems.append("decode_context_tokens must be >= 0")
        if self.hicache_tokens_per_rank < 0:
            problems.append("hicache_tokens_per_rank must be >= 0")
        for name in ("prefill_tokens_per_s", "hicache_load_tokens_per_s", "decode_tokens_per_s",
                     "time_scale", "idle_keepalive_s", "health_timeout_s"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0")
        if self.kv_tokens_per_rank < self.page_tokens:
            problems.append("kv_tokens_per_rank must hold at least one page")
        for rank, mode in self.faults.items():
            if not 0 <= rank < self.dp_size or mode not in FAULT_MODES:
                problems.append(f"bad fault {rank}:{mode}")
        if problems:
            raise ValueError("; ".join(problems))

    def kv_events(self) -> KVEventsConfig | None:
        """The publisher settings when this engine publishes KV events, else None."""
        return parse_config(self.kv_events_config, self.kv_events_format)


def parse_fault(text: str) -> tuple[int, str]:
    """`RANK:MODE` as given to `--fault`, e.g. `3:wedge`."""
    rank, sep, mode = text.partition(":")
    if not sep or not rank.strip().isdigit() or mode not in FAULT_MODES:
        raise ValueError(f"expected RANK:MODE with MODE one of {', '.join(FAULT_MODES)}, got {text!r}")
    return int(rank), mode
