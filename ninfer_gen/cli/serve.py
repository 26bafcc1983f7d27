"""serve: the `ninfer-gen serve` subcommand — loads the model, builds the cohort engine over its lanes
and runs the HTTP server (serve.app: OpenAI Chat Completions / Completions / Responses, Anthropic Messages,
/metrics) with uvicorn. `add_serve_parser(sub)` registers it on the CLI's subparsers."""
from __future__ import annotations

import sys

from ninfer_gen.cli.arg_types import positive_int

DEFAULT_TIMEOUT_S = 600.0        # serve.core's default (not imported: the parser must not load torch)
MAX_IMAGES = 8                   # vision.preprocess.ImageLimits' defaults (not imported, for the same reason)
MAX_IMAGE_PIXELS = 64 * 2**20
GPU_LANES = 8                    # the cohort the engine is built for (the mission: 8 requests on a 24 GB card)
CPU_LANES = 4                    # the reference backend: more lanes add no speed on a few cores


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="HTTP server: OpenAI chat/completions/responses and Anthropic messages over "
                       "the cohort engine")
    s.add_argument("--weights", help="HF checkpoint dir, converted container, a llama.cpp .gguf file or spec YAML (random weights); default: "
                   "the small model shipped in models/")
    s.add_argument("--backend", choices=("auto", "gpu", "reference"), default="auto",
                   help="gpu: the compiled kernels (every bucket and round graph captured at start-up); reference: "
                   "the graph interpreter in torch (CPU or GPU); auto (default): gpu when a CUDA device is visible")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require this key on /v1 paths (Authorization: Bearer KEY or "
                   "x-api-key: KEY)")
    s.add_argument("--lanes", type=int, default=None, help="requests decoded at once (cohort lanes; default: 8 on the "
                   "GPU — fewer when the memory plan cannot hold 8 —, 4 on the reference backend)")
    s.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a lane; beyond it: 429 "
                   "with Retry-After (default 64)")
    s.add_argument("--request-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help="a generation running longer than S seconds (queue included) is cancelled, its lane freed, "
                   f"and answered 504 (streamed: an error event) (default {DEFAULT_TIMEOUT_S:g}; 0: no limit)")
    s.add_argument("--draft", type=int, default=None, help="MTP speculative decoding with K drafts per round "
                   "(default: the spec's runtime.draft_tokens where the model has an MTP layer; 0: plain decode)")
    s.add_argument("--max-gap-ms", type=float, default=None, help="while requests stream, a long prompt is prefilled "
                   "in chunks small enough to keep their gap between tokens under this many ms (measured by the engine; "
                   "its TTFT grows instead). Default: no bound, one full prefill chunk per step")
    s.add_argument("--fixed-draft", action="store_true", help="keep K drafts per round for every request (default: "
                   "adaptive — when the drafting lanes' rounds together do not pay for themselves, by the round cost "
                   "measured at start-up, they drop to plain steps; lossless either way)")
    s.add_argument("--kv-pool-tokens", type=int, default=None, metavar="N", help="gpu: one KV pool of N tokens "
                   "the lanes share (default: every lane's whole context when it fits the budget, else the "
                   "largest pool that does)")
    s.add_argument("--prefix-cache", type=int, default=None, metavar="N", help="prefix reuse: keep N checkpoints "
                   "(KV pages + GDN state) of prompts and answers; a request restores the longest one its prompt "
                   "starts with and prefills the rest (default: 16 on the reference backend, one per lane on the GPU, "
                   "where their states are part of the memory plan; 0: off)")
    s.add_argument("--vram-budget", default="24GiB", help="gpu: device memory to plan for (default 24GiB = RTX 3090)")
    s.add_argument("--served-model-name", default=None, help="the model name clients use (default: the spec's name)")
    s.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="reference activations")
    s.add_argument("--device", default=None, help="reference: cpu or cuda (default: cuda when available)")
    s.add_argument("--max-context", type=positive_int, default=None, help="tokens per sequence (default: the spec's)")
    s.add_argument("--no-verify", action="store_true", help="a converted container: skip checking its hashes")
    s.add_argument("--no-vision", action="store_true", help="do not load the model's vision tower: serve it as a "
                   "text model (less memory and load time; requests with images are refused)")
    from ninfer_gen.cli.run import add_vision_kernels
    add_vision_kernels(s)
    s.add_argument("--tp", type=int, default=1, help="tensor parallel: N rank processes (gloo, reference backend), "
                   "each with 1/N of the heads and MLP columns; rank 0 serves and drives the others (default 1)")
    s.add_argument("--max-images", type=int, default=MAX_IMAGES, metavar="N", help="images one request may send "
                   f"(a model with a vision tower; default {MAX_IMAGES})")
    s.add_argument("--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS, metavar="N", help="pixels an image may "
                   f"have as sent, checked from its header before decoding (default {MAX_IMAGE_PIXELS:,}; at most "
                   "Pillow's decompression-bomb limit, 89,478,485)")
    s.add_argument("--allow-image-urls", action="store_true", help="fetch http(s) image URLs of requests (default: "
                   "off — data URLs and base64 only; the server then makes requests to hosts a client names)")
    s.add_argument("--no-ui", action="store_true", help="no chat page at GET / (the JSON endpoints only)")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    s.set_defaults(func=cmd_serve)


def build_lanes(args):
    """(model, lanes) from parsed arguments: the model loaded for the backend (a rank's share with --tp) and
    the cohort engine's lane adapter over it; a ValueError / RuntimeError says what cannot be served."""
    import ninfer_gen

    if args.backend == "auto":
        import torch
        args.backend = "gpu" if torch.cuda.is_available() and args.device in (None, "cuda") else "reference"
    if args.lanes is None:
        args.lanes = GPU_LANES if args.backend == "gpu" else CPU_LANES
    if args.lanes < 1:
        raise ValueError(f"--lanes must be ≥ 1, got {args.lanes}")
    if args.request_timeout < 0:
        raise ValueError(f"--request-timeout must be ≥ 0 seconds (0: no limit), got {args.request_timeout:g}")
    if args.draft is not None and args.draft < 0:
        raise ValueError(f"--draft must be ≥ 0, got {args.draft}")
    if args.prefix_cache is None:
        args.prefix_cache = args.lanes if args.backend == "gpu" else 16
    if args.prefix_cache < 0:
        raise ValueError(f"--prefix-cache must be ≥ 0 checkpoints (0: off), got {args.prefix_cache}")
    if args.backend == "gpu":
        from ninfer_gen.cli.env import build_root, compile_options
        from ninfer_gen.executor.memory_plan import parse_bytes
        budget = parse_bytes(args.vram_budget)
        _fit_gpu(args, budget)
        model = ninfer_gen.load(args.weights, backend="gpu", max_context=args.max_context, verify=not args.no_verify,
                                vram_budget=budget, progress=True, compile_options=compile_options(),
                                build_root=build_root(), draft=args.draft, cohorts=args.lanes,
                                kv_pool_tokens=args.kv_pool_tokens, prefix_states=args.prefix_cache,
                                random_weights="device" if str(args.weights or "").endswith((".yaml", ".yml")) else "host",
                                vision=not args.no_vision, vision_kernels=args.vision_kernels)
    else:
        model = ninfer_gen.load(args.weights, backend="reference", dtype=args.dtype, device=args.device,
                                max_context=args.max_context, verify=not args.no_verify, draft=args.draft or None,
                                tp=args.tp, vision=not args.no_vision, vision_kernels=args.vision_kernels)
    if args.draft is None:
        args.draft = min(model.spec.runtime.draft_tokens, model.max_draft)
    model.speculative(args.draft)                 # a ValueError naming why K drafts cannot run here
    return model, model.lanes(args.lanes, prefix_cache=args.prefix_cache)


def _spec_of(weights):
    """The model spec of --weights without reading its tensors (the memory plan is made before the load)."""
    from pathlib import Path

    from compiler.spec import load_spec
    from compiler.spec_hf import spec_from_hf_config
    from ninfer_gen.api import DEFAULT_MODEL, TINY_SPEC

    path = Path(weights) if weights else (DEFAULT_MODEL if (DEFAULT_MODEL / "config.json").is_file() else TINY_SPEC)
    from ninfer_gen.weights.gguf_load import is_gguf, open_gguf
    if is_gguf(path):
        return open_gguf(path).spec
    if path.suffix in (".yaml", ".yml"):
        return load_spec(path)
    from ninfer_gen.weights.container import is_container, open_container
    if is_container(path):
        return open_container(path).spec
    return spec_from_hf_config(path / "config.json")


def _fit_gpu(args, budget: int) -> None:
    """The GPU's lanes and KV pool within the budget (the memory plan decides; said on stderr): every lane its
    whole context when that fits, else one shared pool as large as fits, else fewer lanes."""
    from ninfer_gen.executor.memory_plan import MemoryPlanError, plan_memory

    spec = _spec_of(args.weights)
    ctx = args.max_context or spec.runtime.max_context
    page = spec.runtime.page_size

    from ninfer_gen.executor.vision_encoder import DEFAULT_PATCHES
    patches = DEFAULT_PATCHES if spec.vision is not None and not args.no_vision else 0      # the tower, one image

    def plan(lanes: int, pool: int | None):
        return plan_memory(spec, lanes, ctx, budget, draft=args.draft, kv_pool_tokens=pool, prefix_states=lanes,
                           vision_patches=patches)

    asked = args.lanes
    while True:
        try:
            plan(args.lanes, args.kv_pool_tokens)
            break
        except MemoryPlanError as why:
            if args.kv_pool_tokens is None:       # the largest shared pool that fits, in pages
                try:
                    left = plan(args.lanes, ctx)
                    args.kv_pool_tokens = max(ctx, left.kv_pages * page)
                    break
                except MemoryPlanError:
                    pass
            if args.lanes == 1:
                raise ValueError(f"the model does not fit the GPU budget even with one lane: {why}") from None
            args.lanes, args.kv_pool_tokens = args.lanes - 1, None
    args.prefix_cache = min(args.prefix_cache, args.lanes)
    pool = f"a shared KV pool of {args.kv_pool_tokens} tokens" if args.kv_pool_tokens else f"{ctx} tokens per lane"
    fewer = f" (asked {asked}: more do not fit {budget / 2**30:.1f} GiB)" if args.lanes < asked else ""
    print(f"[memory plan: {args.lanes} lanes{fewer}, {pool}, context {ctx} per request, "
          f"{args.prefix_cache} prefix checkpoints]", file=sys.stderr, flush=True)


def image_limits(args):
    """vision.preprocess.ImageLimits from --max-images and --max-image-pixels; a ValueError naming the flag."""
    from PIL import Image

    from ninfer_gen.vision.preprocess import ImageLimits

    if args.max_images < 1:
        raise ValueError(f"--max-images must be ≥ 1, got {args.max_images}")
    if not 1 <= args.max_image_pixels <= Image.MAX_IMAGE_PIXELS:
        raise ValueError(f"--max-image-pixels must be between 1 and {Image.MAX_IMAGE_PIXELS:,} (Pillow's "
                         f"decompression-bomb limit), got {args.max_image_pixels:,}")
    return ImageLimits(max_images=args.max_images, max_input_pixels=args.max_image_pixels)


def build_server(args):
    """(app, engine, model) from parsed arguments (with --tp, on the lead rank: the engine over
    engine.replicated.ReplicatedLanes)."""
    from ninfer_gen.engine import Engine
    from ninfer_gen.serve.app import create_app

    limits = image_limits(args)
    model, lanes = build_lanes(args)
    if args.tp > 1:
        from ninfer_gen.engine.replicated import ReplicatedLanes
        lanes = ReplicatedLanes(lanes)
    if args.max_gap_ms is not None and args.max_gap_ms <= 0:
        raise ValueError(f"--max-gap-ms must be positive, got {args.max_gap_ms}")
    engine = Engine(lanes, lanes=args.lanes, max_queue=args.max_queue, adaptive_draft=not args.fixed_draft,
                    max_gap_s=args.max_gap_ms / 1e3 if args.max_gap_ms is not None else None)
    app = create_app(engine, model, served_model_name=args.served_model_name or model.spec.name,
                     api_key=args.api_key, model_folder=args.weights if args.weights and not
                     str(args.weights).endswith((".yaml", ".yml")) else None, draft=args.draft,
                     request_timeout=args.request_timeout or None, ui=not args.no_ui, image_limits=limits,
                     allow_image_urls=args.allow_image_urls)
    return app, engine, model


def _images_note(args, model) -> str:
    if not model.vision:
        return ""
    urls = "data and http(s) URLs" if args.allow_image_urls else "data URLs only (--allow-image-urls: fetch http(s))"
    return f", images: {args.max_images} per request of at most {args.max_image_pixels:,} pixels, {urls}"


def cmd_serve(args) -> int:
    import uvicorn

    if args.tp > 1:
        from ninfer_gen.cli.ranks import in_rank, is_lead, launch_command, reference_backend
        reference_backend(args, "serve")
        if not in_rank():
            return launch_command(args)
        if not is_lead():                          # a follower: the lead's lane calls on this rank's share
            from ninfer_gen.engine.replicated import follow
            follow(build_lanes(args)[1])
            return 0
    app, engine, model = build_server(args)
    from ninfer_gen.cli.run import vision_note
    note = vision_note(model, not args.no_vision)
    if note:
        print(note, file=sys.stderr)
    name = args.served_model_name or model.spec.name
    ranks = f", tensor parallel over {args.tp} ranks" if args.tp > 1 else ""
    print(f"[serving {name} ({model.source}) on the {args.backend} backend{ranks}, {args.lanes} lanes, max queue "
          f"{args.max_queue}, draft {args.draft} (MTP drafts per round), KV pool "
          f"{getattr(args, 'kv_pool_tokens', None) or 'one context per lane'}, request timeout {args.request_timeout or 'none'}"
          f"{' s' if args.request_timeout else ''}{_images_note(args, model)}; http://{args.host}:{args.port}]",
          file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:                                       # the engine has stopped with the server: release the followers
        if args.tp > 1:
            engine.backend.close()
    return 0
