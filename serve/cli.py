"""``selfspec serve``: an OpenAI-compatible server for the base model and its LoRA adapters.

Every request speculates with the shared heads (unless it sends ``"speculation": false``) and
runs on the adapter its ``model`` field names; the base model's name selects no adapter.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from selfspec.cli_args import parse_dataclass
from selfspec.draft_options import DraftOptions
from selfspec.serve.guard import DEFAULT_MAX_BODY_BYTES
from selfspec.target_options import TargetOptions
from selfspec.tree import parse_tree_spec

PROG = "selfspec serve"
API_KEY_ENV = "SELFSPEC_API_KEY"


@dataclass(frozen=True)
class ServeArgs(DraftOptions, TargetOptions):
    """The target's options (`TargetOptions`: model, dtype, kernels, device, threads), the
    drafting ones (`DraftOptions`: context drafts, draft corpus), then these."""

    heads: str = field(
        default="eagle",
        metadata={
            "help": "heads dir, 'eagle' / 'medusa' for the heads shipped for the default model, "
            "or 'none' (no speculation)"
        },
    )
    adapters_root: str | None = field(
        default=None,
        metadata={
            "help": "every valid adapter directory below it is served by its directory name "
            "(default for the embedded model without --lora-modules: the shipped examples)"
        },
    )
    lora_modules: tuple[str, ...] = field(
        default=(), metadata={"help": "explicit adapters as name=path"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    max_running: int = field(
        default=16,
        metadata={"help": "requests decoded at once (their draft trees verified in one forward)"},
    )
    lora_backend: str = field(
        default="fast",
        metadata={
            "help": "how adapters are applied: fast (stacked weights, per-row in a mixed batch; "
            "adapters it cannot represent fall back to peft) or peft (peft's own layers)"
        },
    )
    adapter_heads: bool = field(
        default=True,
        metadata={
            "help": "requests on an adapter carrying recalibrated heads (<adapter>/heads/) "
            "speculate with them; off: the shared heads for every adapter"
        },
    )
    batch_verify: bool = field(
        default=True,
        metadata={
            "help": "verify the running requests' trees in one target forward; off: one forward "
            "per request, interleaved"
        },
    )
    speculation_gate: bool = field(
        default=True,
        metadata={
            "help": "per batch size, time rounds with and without drafting and run the faster "
            "(outputs unchanged: a round without drafts verifies each root alone); off: every "
            "round of a speculating request drafts"
        },
    )
    prefill_chunk: int = field(
        default=256,
        metadata={
            "help": "prompt tokens the new requests' prefills may run per engine round, so a "
            "long prompt is prefilled over several rounds while the running requests keep "
            "decoding (on the row-invariant kernels, where chunks change no bit; elsewhere "
            "prompts are prefilled whole); 0: every new prompt whole in its first round"
        },
    )
    max_queue: int = field(
        default=64, metadata={"help": "requests waiting for a slot; more are answered 429"}
    )
    max_queue_per_adapter: int | None = field(
        default=None,
        metadata={
            "help": "waiting places one adapter may hold, so a flood on one leaves room for the "
            "others (waiting requests start round-robin across adapters); default: all but a "
            "quarter of --max-queue"
        },
    )
    drain_timeout: float = field(
        default=30.0, metadata={"help": "seconds in-flight requests get to finish on shutdown"}
    )
    enable_lora_management: bool = field(
        default=False,
        metadata={"help": "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter"},
    )
    tree: str = field(
        default="auto",
        metadata={
            "help": "speculation tree of every request: auto (adaptive, sized per step from this "
            "machine's measured cost curve) | adaptive[:TOP_K,DEPTH,MAX_BUDGET] | static | "
            "chain:D | dynamic[:TOP_K,DEPTH,BUDGET] | paths.json"
        },
    )
    prefix_cache_mb: int = field(
        default=512,
        metadata={
            "help": "MiB of prompt-prefix KV kept for reuse across requests (per adapter, LRU; "
            "exact on the row-invariant kernels, off without them); 0: off"
        },
    )
    drift_threshold: float = field(
        default=0.8,
        metadata={
            "help": "flag (gauge + log warning) an adapter whose draft acceptance falls below "
            "this share of the base's; 0: never"
        },
    )
    recalibrate: str = field(
        default="off",
        metadata={
            "help": "background recalibration from served outputs: drift (adapters flagged by "
            "--drift-threshold record their requests' features; a draft delta trained on them in "
            "a separate low-priority process is swapped in when it measures better on a "
            "held-back slice; outputs never change) | always (every adapter once, then when "
            "flagged) | off"
        },
    )
    recalibrate_conversations: int = field(
        default=64,
        metadata={"help": "served requests gathered per background recalibration"},
    )
    recalibrate_save: bool = field(
        default=False,
        metadata={
            "help": "also write a delta swapped in by background recalibration to "
            "<adapter>/heads-delta/ (default: it lives until the server stops)"
        },
    )
    api_key: str | None = field(
        default=None,
        metadata={
            "help": "require 'Authorization: Bearer KEY' on every route but /health (and "
            f"/metrics with --public-metrics); default: ${API_KEY_ENV} when set (preferred: a "
            "command line is visible to every local user)"
        },
    )
    public_metrics: bool = field(
        default=False, metadata={"help": "/metrics answers without the API key"}
    )
    allowed_hosts: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "host names the Host header may carry ('*': any); default: loopback names "
            "when listening on loopback, any otherwise"
        },
    )
    max_body_bytes: int = field(
        default=DEFAULT_MAX_BODY_BYTES,
        metadata={"help": "larger request bodies are answered 413"},
    )
    request_timeout: float | None = field(
        default=None,
        metadata={"help": "seconds a request may run before it is cancelled (504); default none"},
    )
    replicas: int | None = field(
        default=None,
        metadata={
            "help": "serve N engine replicas on Ray Serve behind the same routes, requests for "
            "an adapter routed to a replica holding it (needs selfspec[ray]); default: one "
            "process, no Ray"
        },
    )
    replica_cpus: float = field(
        default=1.0,
        metadata={"help": "with --replicas: Ray CPUs (and default torch threads) per replica"},
    )
    ray_address: str | None = field(
        default=None,
        metadata={"help": "with --replicas: a running Ray cluster to join; default: start one"},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for module in self.lora_modules:
            name, sep, path = module.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules takes name=path, got {module!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_running < 1 or self.max_queue < 0:
            raise ValueError("--max-running must be >= 1 and --max-queue >= 0")
        if self.prefill_chunk < 0:
            raise ValueError(f"--prefill-chunk must be >= 0 tokens, got {self.prefill_chunk}")
        per_adapter = self.max_queue_per_adapter
        if per_adapter is not None and not 0 <= per_adapter <= self.max_queue:
            raise ValueError("--max-queue-per-adapter must be in [0, --max-queue]")
        if self.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout}")
        parse_tree_spec(self.tree)
        if not 0 <= self.drift_threshold <= 1:
            raise ValueError(f"--drift-threshold must be in [0, 1], got {self.drift_threshold}")
        if self.recalibrate not in ("off", "drift", "always"):
            raise ValueError(
                f"--recalibrate must be off, drift or always, got {self.recalibrate!r}"
            )
        if self.recalibrate != "off" and self.heads == "none":
            raise ValueError("--recalibrate needs draft heads (not --heads none)")
        if self.recalibrate_conversations < 4:
            raise ValueError(
                f"--recalibrate-conversations must be >= 4, got {self.recalibrate_conversations}"
            )
        if self.prefix_cache_mb < 0:
            raise ValueError(f"--prefix-cache-mb must be >= 0, got {self.prefix_cache_mb}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"--request-timeout must be > 0, got {self.request_timeout}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")
        if self.lora_backend not in ("fast", "peft"):
            raise ValueError(f"--lora-backend must be fast or peft, got {self.lora_backend!r}")
        if self.replicas is not None and self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.replicas is not None and self.device.startswith("cuda"):
            # Ray gives a replica a GPU only when its actor options ask for one; not wired yet.
            raise ValueError(
                f"--replicas runs its engine replicas on the CPU; --device {self.device} is not "
                "supported with it yet (serve one process on the GPU instead)"
            )
        if not self.replica_cpus > 0:
            raise ValueError(f"--replica-cpus must be > 0, got {self.replica_cpus}")
        if self.replicas is not None and self.enable_lora_management:
            raise ValueError(
                "--enable-lora-management does not combine with --replicas (each replica has "
                "its own adapter store; add adapters under --adapters-root and restart)"
            )


def build_state(args: ServeArgs):  # -> ServerState; imports stay lazy for `selfspec --help`
    from selfspec.adapters.shipped import examples_root
    from selfspec.adapters.store import AdapterStore, StoreConfig
    from selfspec.cost_curve import machine_cost_curve, needs_cost_curve
    from selfspec.generation import SpeculativeGenerator
    from selfspec.heads import load_heads
    from selfspec.prefix_cache import PrefixCache, PrefixCacheConfig
    from selfspec.serve.app import ServerState
    from selfspec.serve.drift import DriftConfig
    from selfspec.serve.recalibration import RecalibrationPolicy
    from selfspec.shipped import resolve_heads_dir
    from selfspec.target import load_target

    target = load_target(args.target_spec())
    is_default = args.is_default_target
    heads = heads_dir = None
    if args.heads != "none":
        heads_dir = resolve_heads_dir(args.heads, is_default)
        heads = load_heads(heads_dir, target.model)
    root = args.adapters_root
    if root is None and is_default and not args.lora_modules:
        root = examples_root()
    modules = dict(m.partition("=")[::2] for m in args.lora_modules)
    store = AdapterStore(
        target.model,
        root=root,
        adapters=modules,
        config=StoreConfig(backend=args.lora_backend),
        base_name=target.name,  # an adapter under the base's name could never be reached
    )
    tree = parse_tree_spec(args.tree)
    # Adaptive trees (the default) size their steps from this machine's measured cost curve.
    curve = (
        machine_cost_curve(store.base_model)
        if heads is not None and needs_cost_curve(tree)
        else None
    )
    generator = SpeculativeGenerator(store.base_model, heads, target.tokenizer, curve)
    if heads is not None:
        generator.corpus = args.corpus_for(target.model, is_default)
    return ServerState(
        generator=generator,
        tokenizer=target.tokenizer,
        model_name=target.name,
        store=store,
        tree=tree,
        max_running=args.max_running,
        max_queue=args.max_queue,
        max_queue_per_adapter=args.max_queue_per_adapter,
        batch_verify=args.batch_verify,
        context_drafts=args.context_drafts_config(),
        speculation_gate=args.speculation_gate,
        prefill_chunk=args.prefill_chunk or None,
        adapter_heads=args.adapter_heads,
        drain_timeout=args.drain_timeout,
        enable_lora_management=args.enable_lora_management,
        access=access_policy(args),
        request_timeout=args.request_timeout,
        drift=DriftConfig(threshold=args.drift_threshold),
        recalibration=(
            None
            if args.recalibrate == "off"
            else RecalibrationPolicy(
                trigger=args.recalibrate,
                conversations=args.recalibrate_conversations,
                save=args.recalibrate_save,
            )
        ),
        heads_dir=heads_dir,
        target_model=None if is_default else args.model,
        prefix_cache=(
            PrefixCache(PrefixCacheConfig(max_bytes=args.prefix_cache_mb << 20))
            if args.prefix_cache_mb
            else None
        ),
    )


def access_policy(args: ServeArgs):  # -> AccessPolicy
    """Who may call the server and how large a request may be, from the arguments."""
    from selfspec.serve.guard import AccessPolicy

    return AccessPolicy.for_bind_address(
        args.host,
        _is_loopback(args.host),
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        public_metrics=args.public_metrics,
        allowed_hosts=args.allowed_hosts,
        max_body_bytes=args.max_body_bytes,
    )


def how_to_call(host: str, port: int, model: str) -> str:
    shown = f"[{host}]" if ":" in host else host
    if host in ("0.0.0.0", "::"):
        shown = "127.0.0.1"
    body = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'
    return (
        f"curl http://{shown}:{port}/v1/chat/completions "
        f"-H 'Content-Type: application/json' -d '{body}'"
    )


def main(argv: Sequence[str]) -> int:
    args = parse_dataclass(ServeArgs, argv, description=__doc__, prog=PROG)
    if args.replicas is not None:
        from selfspec.serve.ray_cli import serve_on_ray

        return serve_on_ray(args)
    import uvicorn

    from selfspec.serve.app import create_app
    from selfspec.serve.draining import DrainingServer

    try:
        state = build_state(args)
    # TargetLoadError, HeadsCheckpointError, FingerprintMismatch and AdapterError are ValueErrors.
    except (FileNotFoundError, ValueError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    if not _is_loopback(args.host) and state.access.api_key is None:
        print(
            f"{PROG}: warning: listening on {args.host}, not only on this machine, without an "
            f"API key (--api-key or ${API_KEY_ENV})",
            file=sys.stderr,
        )
    store = state.store
    adapters = ", ".join(sorted(state.served)) or "none"
    print(f"serving {state.model_name} (heads: {args.heads}) with adapters: {adapters}")
    if store is not None and store.rejected:
        for name, why in sorted(store.rejected.items()):
            print(f"  not served: {name}: {why}", file=sys.stderr)
    print("call it with:\n  " + how_to_call(args.host, args.port, state.model_name), flush=True)
    if state.served:
        example = sorted(state.served)[0]
        print(f'  (set "model" to an adapter, e.g. "{example}"; GET /v1/models lists them)')
    config = uvicorn.Config(
        create_app(state),
        host=args.host,
        port=args.port,
        # After the drain (DrainingServer), open responses get a few seconds to send their end.
        timeout_graceful_shutdown=5,
    )
    DrainingServer(config, state).run()
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


__all__ = ["ServeArgs", "build_state", "how_to_call", "main"]
