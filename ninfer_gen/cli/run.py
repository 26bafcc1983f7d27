"""run: the `ninfer-gen run` command — load a model (the GPU or the reference backend), then one prompt streamed
as it is generated with a summary line (time to first token, decode tok/s, acceptance), or several prompts as
one cohort (cli.run_cohort), or the same command in `--tp` rank processes (cli.ranks). `--image` files go in
front of each prompt as the model's image placeholder blocks (no chat template: run encodes the prompt as it is)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from ninfer_gen.cli.arg_types import positive_int
from ninfer_gen.cli.run_cohort import COHORT_LANES, cohort_size, prompts_of, run_cohort


def cmd_run(args) -> int:
    import ninfer_gen
    from ninfer_gen.sampling import SamplingParams
    from ninfer_gen.speculative import Stats

    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)  # validate before loading
    prompts = prompts_of(args)
    image_data = read_images(args.image)                                         # before the load, as the prompts
    if image_data and args.no_vision:
        raise ValueError("--image needs the model's vision tower, which --no-vision leaves out")
    if image_data and args.tp > 1:
        raise ValueError(f"--image runs the vision tower on one process: use it without --tp {args.tp}")
    if args.tp > 1:
        from ninfer_gen.cli.ranks import in_rank, launch_command, reference_backend
        reference_backend(args, "run")
        if not in_rank():
            return launch_command(args)
    if args.backend == "auto":
        import torch
        args.backend = "gpu" if torch.cuda.is_available() and args.device in (None, "cuda") else "reference"
    if args.backend == "gpu":
        from ninfer_gen.cli.env import build_root, compile_options
        from ninfer_gen.executor.memory_plan import parse_bytes
        model = ninfer_gen.load(args.weights, backend="gpu", max_context=args.max_context,
                                random_weights="device" if args.random_weights else "host",
                                vram_budget=parse_bytes(args.vram_budget), use_graphs=not args.no_graphs,
                                progress=True, compile_options=compile_options(), build_root=build_root(), draft=args.draft,
                                verify=not args.no_verify, state_mode=args.state_mode, draft_vocab=args.draft_vocab,
                                cohorts=cohort_size(args, prompts), arch_path=args.arch_path, vision=not args.no_vision,
                                vision_kernels=args.vision_kernels)
    else:
        if args.random_weights:
            raise ValueError("--random-weights draws weights on the GPU: use it with --backend gpu")
        if args.arch_path is not None:
            raise ValueError(f"--arch-path {args.arch_path} chooses the GPU's code path: use it with --backend gpu")
        model = ninfer_gen.load(args.weights, backend=args.backend, dtype=args.dtype, quantize=args.quantize,
                                device=args.device, max_context=args.max_context, verify=not args.no_verify,
                                tp=args.tp, vision=not args.no_vision, vision_kernels=args.vision_kernels)
    tok = model.tokenizer
    print(f"[model: {model.source}; backend: {args.backend} on {model.backend.device}; tokenizer: {tok.name}]",
          file=sys.stderr)
    note = vision_note(model, not args.no_vision)
    if note:
        print(note, file=sys.stderr)
    images = prepare_images(model, image_data)
    if args.backend == "gpu":
        model.lanes(cohort_size(args, prompts), round_mode=args.round_mode)     # made (captured, warm) once
    if len(prompts) > 1 or args.json:
        return run_cohort(model, args, prompts, params, _draft(model, args.draft), images)
    ids = tok.encode(prompts[0])
    if images is not None:
        ids = model.image_prompt(ids, images)
    if not ids:
        raise ValueError("the prompt is empty")
    draft = _draft(model, args.draft)
    stats = Stats()
    t0 = time.perf_counter()
    first = None
    new: list[int] = []
    shown = ""
    sys.stdout.write(prompts[0])
    for token in model.stream(ids, args.max_tokens, params, model.eos_ids, draft, stats,
                              adaptive_draft=not args.fixed_draft, images=images):
        first = first or time.perf_counter()
        new.append(token)
        text = tok.decode([t for t in new if t not in model.eos_ids])
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    end = time.perf_counter()
    sys.stdout.write("\n")
    decode_s = end - (first or end)
    rate = (len(new) - 1) / decode_s if len(new) > 1 and decode_s > 0 else 0.0
    spec_line = (f"; {draft} drafts per round: acceptance {stats.acceptance:.1%}, {stats.tokens_per_round:.2f} tokens "
                 f"per round over {stats.rounds} rounds" if draft else "; plain decode")
    print(f"[{len(ids)} prompt tokens, {len(new)} new tokens; time to first token "
          f"{((first or end) - t0) * 1e3:.0f} ms; decode {rate:.1f} tok/s{spec_line}]", file=sys.stderr)
    return 0


def read_images(paths) -> list[bytes]:
    """The bytes of each --image file, in order (a missing or unreadable file is an error naming it)."""
    out = []
    for i, name in enumerate(paths or (), 1):
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"image {i}: no such file: {path}")
        try:
            out.append(path.read_bytes())
        except OSError as err:
            raise ValueError(f"image {i}: cannot read {path}: {err.strerror or err}") from None
    return out


def prepare_images(model, data: list[bytes]):
    """--image files → the model's encoder input (vision.preprocess.Processed), said on stderr; None without
    images. A model that takes no images, or an image it cannot use, is a ValueError saying which and why."""
    if not data:
        return None
    images = model.prepare_images(data)
    tokens = ", ".join(f"{t}×{h}×{w} patches → {n} tokens" for (t, h, w), n in zip(images.grids, images.tokens))
    print(f"[{len(data)} image{'s' if len(data) > 1 else ''}: {tokens}]", file=sys.stderr)
    return images


def add_vision_kernels(parser) -> None:
    """`--vision-kernels`, the same on run, serve and bench."""
    parser.add_argument("--vision-kernels", action="store_true", help="GPU, a model with its vision tower: run the "
                        "tower on the compiler's encoder plans instead of torch (opt-in: correct on the GPU tier, but "
                        "on the H100 the 27B's encoder took 89.9 ms per 1024² image against torch's 42.1; the memory "
                        "plan counts its packed weights and arena)")


def vision_note(model, vision: bool) -> str | None:
    """The load line about the vision tower: its size when loaded, else why images are refused (None for a
    text model loaded as asked)."""
    if not vision:
        return "[vision tower not loaded (--no-vision): images are refused]"
    v = model.spec.vision
    if v is None:
        return None
    if not model.vision:
        return "[vision tower not loaded (the checkpoint stores none): images are refused]"
    from compiler.spec import vision_tensor_table
    from ninfer_gen.cli.weights_cmds import fmt_bytes

    fmt = model.spec.quantization.vision
    size = sum(t.numel for t in vision_tensor_table(model.spec)) * (2 if fmt == "bf16" else 4)
    return f"[vision tower: {v.depth} blocks, {fmt_bytes(size)} {fmt}]"


def _draft(model, asked: int | None) -> int:
    """--draft K as asked (an unsupported K > 0 is an error naming why); unset: the spec's draft length
    where the model and backend can draft, else plain decode (said on stderr)."""
    if asked is not None:
        if asked < 0:
            raise ValueError(f"--draft must be ≥ 0, got {asked}")
        model.speculative(asked)
        return asked
    draft = model.spec.runtime.draft_tokens
    try:
        return draft if model.speculative(draft) else 0
    except ValueError as why:
        print(f"[{why}: plain decode]".replace(": use --draft 0", ""), file=sys.stderr)
        return 0


def add_run_parser(sub) -> None:
    """The `run` subcommand and its options on the `ninfer-gen` parser's subparsers."""
    r = sub.add_parser("run", help="generate completions: one prompt, or several as one cohort")
    r.add_argument("--weights", help="HF checkpoint dir, converted container (ninfer-gen convert), a llama.cpp .gguf file or spec YAML "
                   "(random weights); default: the small model shipped in models/")
    r.add_argument("--no-verify", action="store_true", help="a converted container: skip checking its sha256 hashes")
    r.add_argument("--prompt", action="append", help="the prompt; repeat it for several, which run as one cohort "
                   "through the engine (one lane per prompt), each streamed to its own [i] lines")
    r.add_argument("--image", action="append", metavar="PATH", help="an image file (PNG, JPEG, WEBP, GIF, BMP) "
                   "for a model with a vision tower (either backend); repeat it for several. The images' "
                   "placeholder blocks go in front of the prompt, in order (every prompt of a cohort gets them)")
    r.add_argument("--no-vision", action="store_true", help="do not load the model's vision tower: a text model "
                   "(less memory and load time; images are refused)")
    add_vision_kernels(r)
    r.add_argument("--prompts-file", default=None, help="a text file of prompts, one per line (blank lines "
                   "skipped), after any --prompt")
    r.add_argument("--lanes", type=int, default=None, help=f"several prompts: lanes of the cohort (default: one per "
                   f"prompt, at most {COHORT_LANES}); more prompts than lanes wait in the engine's queue")
    r.add_argument("--json", action="store_true", help="print one JSON object per request and line instead of the "
                   "text: index, text, tokens, ttft_ms, decode_tok_s, acceptance (null without drafts), "
                   "tokens_per_round, prompt_tokens, finish, error")
    r.add_argument("--max-tokens", type=positive_int, default=96, help="new tokens per prompt at most (default 96)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    r.add_argument("--top-k", type=int, default=0)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--backend", choices=("auto", "reference", "gpu"), default="auto",
                   help="gpu: the compiled kernels with CUDA graphs (weights always in the spec's quantised "
                   "formats); reference: the graph interpreter in torch (any device); auto (default): gpu "
                   "when a CUDA device is visible, else reference")
    r.add_argument("--tp", type=int, default=1, help="tensor parallel: N rank processes (gloo, reference backend), "
                   "each with 1/N of the heads and MLP columns (default 1)")
    r.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="reference activations")
    r.add_argument("--quantize", action="store_true", help="reference: apply the spec's weight quantisation recipe")
    r.add_argument("--device", default=None, help="reference: cpu or cuda (default: cuda when available)")
    r.add_argument("--random-weights", action="store_true",
                   help="gpu: with a spec YAML, draw the weights on the GPU in their quantised formats (seed 0)")
    r.add_argument("--max-context", type=positive_int, default=None, help="tokens per sequence (default: the spec's)")
    r.add_argument("--vram-budget", default="24GiB", help="gpu: memory budget (default 24GiB = RTX 3090)")
    r.add_argument("--no-graphs", action="store_true", help="gpu: launch kernels one by one (no CUDA graphs)")
    r.add_argument("--draft", type=int, default=None, help="MTP speculative decoding with K drafts per round "
                   "(default: the spec's, where the model has an MTP layer and the backend drafts; 0 = plain "
                   "decode); prints the acceptance and tokens per round")
    r.add_argument("--fixed-draft", action="store_true", help="keep K drafts per round (default: adaptive — when "
                   "the drafting requests' rounds together do not pay for themselves, by the round cost measured at "
                   "start-up on the GPU, they drop to plain steps; lossless either way)")
    r.add_argument("--round-mode", choices=("fused", "eager"), default="fused",
                   help="gpu: how a speculative round runs — fused (default): one CUDA graph per round, the fold of "
                   "the accepted tokens its first kernels, two rounds in flight; eager: the fold its own graph "
                   "after the host has read the round")
    r.add_argument("--state-mode", choices=("replayssm", "snapshot"), default="replayssm",
                   help="gpu: replayssm (default): verify logs per-token records and folds the accepted ones; "
                   "snapshot: verify keeps K+1 copies of the GDN state (the common design, for comparison)")
    r.add_argument("--arch-path", default=None, metavar="CARD|sm_XX", help="gpu: run another card's code path as PTX "
                   "the driver JIT-compiles: rtx3090 (the RTX 3090's kernels exactly) or sm_86 (that arch's code, "
                   "grids sized for this GPU's SMs); default: the GPU's own")
    r.add_argument("--draft-vocab", default=None, help="gpu: a draft_vocab.json (ninfer-gen draft-vocab): the MTP "
                   "drafts from those token ids only (a reduced LM head); verification still uses the full head")
    r.set_defaults(func=cmd_run)
