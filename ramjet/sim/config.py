"""Settings of one simulated SGLang engine, declared once.

Each field of SimConfig carries its type, default, limits and help text; `ramjet sim`
generates its flags from them (ramjet/sim/cli.py): field `foo_bar` is `--foo-bar VALUE`
unless a `Flag` says otherwise, and a field marked `FromEnv` is read from SGLang's
environment variable instead. Defaults model GLM-5.3 on one 8xH200 server with DP
attention over 8 ranks and an FP8 KV cache; docs/simulator.md explains each number.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from ramjet.sim.kv_wire import FORMATS, KVEventsConfig, parse_config, tcp_port

VERSION = "0.5.20"
FaultMode = Literal["none", "wedge", "error", "slow"]
FAULT_MODES: tuple[str, ...] = get_args(FaultMode)
SLOW_FACTOR = 10.0


def parse_fault(text: str) -> tuple[int, str]:
    """`RANK:MODE` as given to `--fault`, e.g. `3:wedge`."""
    rank, sep, mode = text.partition(":")
    if not sep or not rank.strip().isdigit() or mode not in FAULT_MODES:
        raise ValueError(f"expected RANK:MODE with MODE one of {', '.join(FAULT_MODES)}, got {text!r}")
    return int(rank), mode


def parse_header(text: str) -> tuple[str, str]:
    """`NAME:VALUE` as given to `--response-header`, e.g. `Set-Cookie: a=b`."""
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"expected NAME:VALUE, got {text!r}")
    return name.strip(), value.strip()


@dataclass(frozen=True)
class Flag:
    """A field's command-line spelling where `--field-name VALUE` does not fit. A dict field's
    flag is repeatable, each occurrence one `item` (text -> key, value)."""

    name: str | None = None
    metavar: str | None = None
    item: Callable[[str], tuple] | None = None


@dataclass(frozen=True)
class FromEnv:
    """A field SGLang reads from this environment variable rather than from a flag."""

    var: str


# An empty text means the setting is not given (`--api-key ""` requires no key), as with the old flags.
Text = Annotated[str | None, BeforeValidator(lambda v: None if v == "" else v)]


class SimConfig(BaseModel):
    """One engine's settings; `SimConfig(dp_size=2, ...)` or `ramjet sim --dp-size 2 ...`.

    Field order matters: a validator sees the fields above it in `info.data`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False)

    dp_size: int = Field(8, ge=1, description="DP attention ranks, each with a private cache")
    model_name: str = Field("glm-5.3", description="served model name")
    api_key: Annotated[Text, Flag(metavar="KEY")] = Field(
        None, repr=False, description="require Authorization: Bearer KEY (not on /health*)")
    kv_tokens_per_rank: int = Field(193_000, ge=1, description="KV pool per rank in tokens "
                                    "(193000: GLM-5.3, DP8, FP8 KV on H200)")
    page_tokens: int = Field(64, ge=1, description="cache page size in tokens")
    hicache_tokens_per_rank: int = Field(0, ge=0, description="host-memory cache tier per rank in tokens (0 = off)")
    prefill_tokens_per_s: float = Field(6_500.0, gt=0, description="prefill speed of one rank "
                                        "(an 86K-token prompt takes ~13 s cold)")
    hicache_load_tokens_per_s: float = Field(95_000.0, gt=0,
                                             description="host tier reload speed (86K tokens in ~0.9 s)")
    decode_tokens_per_s: float = Field(180.0, gt=0, description="one request's decode speed with no context "
                                       "(fitted, docs/simulator.md)")
    max_running_per_rank: int = Field(16, ge=1, description="running requests per rank (the one in prefill counts)")
    chunked_prefill: int = Field(32_768, ge=1, description="SGLang's --chunked-prefill-size: each DP rank "
                                 "prefills chunks of this / --dp-size tokens")
    prefill_decode_share: float = Field(0.5, gt=0, le=1, description="share of its decode speed every rank keeps "
                                        "while any rank prefills (DP ranks share passes; fitted)")
    decode_context_tokens: int = Field(20_000, ge=0, description="a rank decodes 1 + (its running requests' "
                                       "context) / this times slower; 0: never")
    time_scale: float = Field(1.0, gt=0, description="engine work runs this many times faster than real time "
                              "(transport timings stay real)")
    idle_keepalive_s: float = Field(5.0, gt=0, description="close idle keep-alive connections after this many "
                                    "real seconds")
    health_generation: Annotated[bool, FromEnv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION")] = Field(
        True, description="/health generates a token (else it answers 200 at once)")
    health_timeout_s: Annotated[float, FromEnv("SGLANG_HEALTH_CHECK_TIMEOUT")] = Field(
        20.0, gt=0, description="real seconds a health check waits for a token before 503")
    ideal_max_pages: int = Field(1_000_000, ge=1, description="pages the engine-wide ideal cache remembers "
                                 "(ideal_cached_tokens)")
    faults: Annotated[dict[int, FaultMode], Flag(name="--fault", metavar="RANK:MODE", item=parse_fault)] = Field(
        default_factory=dict, description=f"inject a fault at start; MODE is one of {', '.join(FAULT_MODES)}")
    # test hooks for a balancer's hardening: headers added to every answer (a hostile or misconfigured engine),
    # and a text that makes every rank answer 500 (an input the engine cannot handle: a "query of death")
    response_headers: Annotated[dict[str, str], Flag(name="--response-header", metavar="NAME:VALUE",
                                                     item=parse_header)] = Field(
        default_factory=dict, description="add this header to every answer (test hook: a hostile or "
        "misconfigured engine)")
    poison_text: Annotated[Text, Flag(metavar="TEXT")] = Field(
        None, description="answer 500 on every rank to any prompt containing TEXT (test hook: a query of death)")
    tokenizer_dir: Annotated[Text, Flag(name="--tokenizer", metavar="DIR")] = Field(
        None, description="a Hugging Face tokenizer directory (tokenizer.json, chat template) instead of the "
        "shipped one")
    kv_events_format: Literal[FORMATS] = Field("sglang", description="whose wire format the events follow")
    kv_events_config: Annotated[Text, Flag(metavar="JSON")] = Field(
        None, description='publish KV cache events, e.g. \'{"publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5657"}\' (vLLM format also needs "enable_kv_cache_events": true)')
    load_publish_endpoint: Annotated[Text, Flag(metavar="auto|off|tcp://HOST:PORT")] = Field(
        None, description="SGLang's per-rank load publisher (needs --kv-events-config, SGLang format)")

    @field_validator("page_tokens")
    @classmethod
    def _page_fits_the_pool(cls, page: int, info: ValidationInfo) -> int:
        pool = info.data.get("kv_tokens_per_rank")
        if pool is not None and page > pool:
            raise ValueError(f"a page of {page} tokens does not fit in kv_tokens_per_rank ({pool})")
        return page

    @field_validator("faults")
    @classmethod
    def _faults_on_existing_ranks(cls, faults: dict[int, str], info: ValidationInfo) -> dict[int, str]:
        dp_size = info.data.get("dp_size")
        for rank in faults if dp_size is not None else ():
            if not 0 <= rank < dp_size:
                raise ValueError(f"rank {rank} is not in [0, dp_size={dp_size})")
        return faults

    @field_validator("kv_events_config")
    @classmethod
    def _events_config_parses(cls, text: str | None, info: ValidationInfo) -> str | None:
        if "kv_events_format" in info.data:
            parse_config(text, info.data["kv_events_format"])  # raises ValueError naming what is wrong
        return text

    @field_validator("load_publish_endpoint")
    @classmethod
    def _load_publisher_has_events(cls, endpoint: str | None, info: ValidationInfo) -> str | None:
        if endpoint in (None, "off"):
            return endpoint
        if endpoint != "auto" and tcp_port(endpoint) is None:
            raise ValueError("must be auto, off or tcp://HOST:PORT")
        fmt, events = info.data.get("kv_events_format"), info.data.get("kv_events_config")
        if fmt is not None and "kv_events_config" in info.data and (
                fmt != "sglang" or parse_config(events, fmt) is None):
            raise ValueError("needs SGLang-format KV events (--kv-events-config publishing with zmq)")
        return endpoint

    def kv_events(self) -> KVEventsConfig | None:
        """The publisher settings when this engine publishes KV events, else None."""
        return parse_config(self.kv_events_config, self.kv_events_format)
