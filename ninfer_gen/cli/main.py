"""cli: the `ninfer-gen` command — check, plan, build, inspect; run (cli.run), convert, bench, serve. Turns every
input error into one clear line (`error: ...`, exit 2), never a traceback; parses arguments and delegates, computing
nothing itself."""
from __future__ import annotations

import argparse
import sys
from collections import Counter

from compiler.schema import SpecError
from ninfer_gen.cli.arg_types import positive_int
from ninfer_gen.cli.run import add_run_parser
from ninfer_gen.cli.weights_cmds import CONVERT_DESCRIPTION, cmd_convert, cmd_draft_vocab, fmt_bytes

EPILOG = """examples:
  ninfer-gen run --prompt "def fibonacci(n):"        the small model shipped in models/
  ninfer-gen run --weights <HF dir> --prompt "..."    any Qwen3.5/3.6/3.8 checkpoint
  ninfer-gen run --weights <HF dir> --backend reference --image photo.png --prompt "Describe it:"
  ninfer-gen convert <HF dir> <out>                   quantise once; then run --weights <out>
  ninfer-gen check model_specs/qwen3.8-27b.yaml       validate a spec and print its sizes
  ninfer-gen plan model_specs/qwen3.8-27b.yaml --cohorts 8 --max-context 16384
  ninfer-gen build model_specs/qwen3.8-27b.yaml --target rtx3090 --cohorts 1,2,4,8 --draft 3
  ninfer-gen inspect model_specs/qwen3.8-tiny.yaml --entry step --batch 2 --tokens 4
  ninfer-gen run --backend gpu --prompt "def f(x):"   the small model on the compiled kernels
  ninfer-gen run --backend gpu --weights model_specs/qwen3.8-27b.yaml --random-weights --prompt hi
  ninfer-gen bench model_specs/qwen3.8-27b.yaml --json bench.json   27B, random weights, 24 GiB
"""


BUILD_DESCRIPTION = ("Plans every bucket of the runtime profile (step B×1 and B×(draft+1) per cohort size, prefill at "
                     "the chunk and each 16·2^i below it) and compiles exactly the kernels those plans launch. "
                     "NINFER_* variables (README) choose the compile options.")


def cmd_check(args) -> int:
    from compiler.sizes import summary
    from compiler.spec import load_spec

    s = summary(load_spec(args.spec))
    rows = [("model", s["name"]),
            ("parameters", f"{s['parameters'] / 1e9:.3f} B" if s["parameters"] > 1e8 else f"{s['parameters']:,}"),
            ("layers", ", ".join(f"{v} {k}" for k, v in s["layers"].items())),
            ("bytes per quantised forward", fmt_bytes(s["bytes_per_forward"])),
            ("MTP bytes per draft step", fmt_bytes(s["mtp_bytes_per_draft"])),
            ("GDN state per sequence", fmt_bytes(s["gdn_state_bytes_per_sequence"])),
            ("conv history per sequence", fmt_bytes(s["conv_history_bytes_per_sequence"])),
            ("KV per token (bf16 / int8-g64)",
             f"{fmt_bytes(s['kv_bytes_per_token_bf16'])} / {fmt_bytes(s['kv_bytes_per_token_int8'])}")]
    print(f"{args.spec}: valid")
    for k, v in rows:
        print(f"  {k:<32} {v}")
    return 0


def cmd_plan(args) -> int:
    import json

    from compiler.shard import shard_spec
    from compiler.spec import load_spec
    from ninfer_gen.executor.memory_plan import GiB, kv_pool_pages, parse_bytes, plan_memory

    spec = shard_spec(load_spec(args.spec), args.tp)          # --tp: one card's share
    images = spec.vision is not None and not args.no_vision and args.tp == 1
    plan = plan_memory(spec, args.cohorts, args.max_context or spec.runtime.max_context,
                       parse_bytes(args.vram_budget), args.draft, args.kv, kv_pool_tokens=args.kv_pool_tokens,
                       vision_patches=args.vision_patches if images else 0)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
        return 0
    card = f", per card of {args.tp} (tensor parallel)" if args.tp > 1 else ""
    print(f"{spec.name}: {plan.cohort} lane(s), draft {plan.draft_tokens}, max context {plan.max_context}, "
          f"{plan.kv_dtype} KV, budget {plan.budget / GiB:.2f} GiB{card}")
    for name, size in plan.rows():
        print(f"  {name:<46} {size / GiB:8.3f} GiB")
    print(f"  {'total':<46} {plan.total / GiB:8.3f} GiB")
    if args.kv_pool_tokens:
        pool = kv_pool_pages(plan.cohort, plan.max_context, plan.page_size, args.kv_pool_tokens) * plan.page_size
        used = pool * plan.kv_bytes_per_token
        print(f"  the lanes share a KV pool of {pool} tokens ({used / GiB:.3f} GiB): "
              f"{(plan.kv_pool - used) / GiB:.3f} GiB of the budget stay free")
    else:
        print(f"  KV holds {plan.kv_tokens} tokens = {plan.kv_tokens // plan.cohort} per lane")
    return 0


def _profile(spec, cohorts: str | None = None, draft: int | None = None, max_context: int | None = None,
             kv: str | None = None, images: bool = False):
    """The runtime profile the command plans: the spec's, with the command's choices and the NINFER_*
    compile options (`images`: the M-RoPE plans a load with the vision tower runs)."""
    from compiler.buckets import profile_of
    from ninfer_gen.cli.env import compile_options

    return profile_of(spec, cohorts=_int_list(cohorts) if cohorts else None, draft=draft, max_context=max_context,
                      kv_dtype=kv, options=compile_options(), images=images)


def cmd_build(args) -> int:
    from compiler.build_cache import build_kernels
    from compiler.buckets import plan_profile, plan_rounds, profile_keys
    from compiler.shard import check_quantised_shares, shard_spec
    from compiler.spec import load_spec
    from compiler.targets import resolve

    spec = shard_spec(load_spec(args.spec), args.tp)          # --tp: each rank's graphs (all ranks' are alike)
    if args.tp > 1:
        check_quantised_shares(spec)
    target = resolve(args.target, args.arch)
    images = spec.vision is not None and not args.no_vision and args.tp == 1       # what a GPU load with the tower runs
    profile = _profile(spec, args.cohorts, args.draft, args.max_context, args.kv, images)
    plans = plan_profile(spec, target, profile)
    rank = f"; each of {args.tp} ranks, {sum(len(p.collectives()) for p in plans.values())} collectives in its " \
        "buckets (the NCCL runtime that would launch them is not built yet)" if args.tp > 1 else ""
    print(f"{spec.name} for {target.name} ({target.arch}): {profile.describe()}{rank}")
    print(f"  {'bucket':<22} {'launches':>8} {'arena MiB':>10}")
    for (entry, b, t), plan in plans.items():
        print(f"  {f'{entry} B={b} T={t}':<22} {plan.launches:>8} {plan.arena_bytes / 2**20:>10.1f}")
    rounds = plan_rounds(spec, target, profile)
    for (b, acceptance), r in rounds.items():
        print(f"  {f'round B={b} {acceptance}':<22} {len(r.steps):>8} steps, {len(r.calls())} round calls")
    keys = profile_keys(plans, rounds)
    if images and args.vision_kernels:         # the encoder's plans (opt-in: executor.vision_plan)
        from compiler.buckets_vision import plan_vision_profile
        encoder = plan_vision_profile(spec, target)
        for tokens, plan in encoder.items():
            print(f"  {f'vision tokens={tokens}':<22} {plan.launches:>8} {plan.arena_bytes / 2**20:>10.1f}")
        keys = list(dict.fromkeys(keys + [k for plan in encoder.values() for k in plan.keys()]))
    print(f"  kernels: {len(keys)}, every one launched by this profile's plans and rounds")
    summary = build_kernels(keys, jobs=args.jobs, root=args.build_dir, ptx=args.ptx)
    print(summary.table())
    return 0 if summary.spills == 0 else 1


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


def cmd_inspect(args) -> int:
    from compiler.spec import load_spec
    from compiler.trace import StatePools, trace

    spec = load_spec(args.spec)
    if args.plan:
        from compiler.buckets import plan_bucket
        from compiler.plan import format_plan
        from compiler.targets import resolve

        profile = _profile(spec, max_context=args.max_context, kv=args.kv)
        print(format_plan(plan_bucket(spec, resolve(args.target, args.arch), args.entry, args.batch, args.tokens,
                                      profile)))
        return 0
    per_seq = -(-(args.max_context or spec.runtime.max_context) // spec.runtime.page_size)
    pools = StatePools(per_seq * args.batch, args.batch, per_seq, spec.runtime.page_size, args.kv or "int8")
    g = trace(spec, args.entry, args.batch, args.tokens, pools, args.act)
    if args.stats:
        counts = Counter(e.prim for e in g.eqns)
        print(f"{g.name}: {len(g.eqns)} equations, {len(g.weights)} weights, {len(g.state)} state tensors")
        for prim, n in counts.most_common():
            print(f"  {prim:<18} {n}")
    else:
        print(g)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ninfer-gen", description="A compiler-style inference engine for the "
                                "Qwen3.5/3.8 hybrid family (Gated DeltaNet + gated attention + MTP).",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = sub.add_parser("check", help="validate a model spec and print its sizes")
    c.add_argument("spec", help="path to a model spec YAML")
    c.set_defaults(func=cmd_check)
    pl = sub.add_parser("plan", help="split a VRAM budget into weights, state, arena and KV pool")
    pl.add_argument("spec", help="path to a model spec YAML")
    pl.add_argument("--cohorts", type=int, default=8, help="concurrent lanes (state slots)")
    pl.add_argument("--max-context", type=positive_int, default=None, help="tokens per lane (default: the spec's)")
    pl.add_argument("--vram-budget", default="24GiB", help="device memory to plan for (default 24GiB = RTX 3090)")
    pl.add_argument("--draft", type=int, default=None, help="MTP draft tokens (default: the spec's)")
    pl.add_argument("--kv", choices=("int8", "bf16"), default=None, help="KV cache dtype (default: the spec's)")
    pl.add_argument("--kv-pool-tokens", type=int, default=None,
                    help="one KV pool of this many tokens shared by the lanes (default: every lane its whole context)")
    pl.add_argument("--tp", type=int, default=1, help="tensor-parallel cards: plan one card's share (default 1)")
    pl.add_argument("--no-vision", action="store_true", help="a spec with a vision tower: plan a text-only load "
                    "(default: the tower and one image of --vision-patches, as a GPU load with the tower holds them)")
    pl.add_argument("--vision-patches", type=int, default=4096, help="the largest image the plan holds, in patches "
                    "(default 4096: one megapixel on 16-pixel patches)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(func=cmd_plan)
    b = sub.add_parser("build", help="trace, lower and compile every kernel a runtime profile launches (NVRTC → build/)",
                       description=BUILD_DESCRIPTION)
    b.add_argument("spec", help="path to a model spec YAML")
    b.add_argument("--target", default=None, help="card: rtx3090 (default), rtx3080, a6000, a100, rtx4090, h200")
    b.add_argument("--arch", default=None, help="sm_80 | sm_86 | sm_87 | sm_89 | sm_90 (wins over --target)")
    b.add_argument("--cohorts", default=None, help="cohort sizes, e.g. 1,2,4,8 (default: the spec's)")
    b.add_argument("--draft", type=int, default=None, help="MTP draft tokens (default: the spec's)")
    b.add_argument("--max-context", type=positive_int, default=None, help="tokens per sequence (default: the spec's)")
    b.add_argument("--kv", choices=("int8", "bf16"), default=None, help="KV cache dtype (default: the spec's)")
    b.add_argument("--tp", type=int, default=1, help="tensor parallel: compile one rank's kernels of N (all ranks' "
                   "are the same; the NCCL runtime that would run them is not built yet)")
    b.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: CPU count)")
    b.add_argument("--build-dir", default="build", help="cache root (default: build/)")
    b.add_argument("--ptx", action="store_true", help="also emit PTX for the arch (compute_XX)")
    b.add_argument("--no-vision", action="store_true", help="a spec with a vision tower: build the text model's "
                   "plans (what `--no-vision` loads run) instead of the M-RoPE plans a load with the tower runs")
    b.add_argument("--vision-kernels", action="store_true", help="a spec with a vision tower: also build the "
                   "encoder's plans (one per image-token bucket), which GpuBackend(vision_kernels=True) runs")
    b.set_defaults(func=cmd_build)
    i = sub.add_parser("inspect", help="trace an entry point and print its graph IR, or (--plan) its lowered plan")
    i.add_argument("spec", help="path to a model spec YAML")
    i.add_argument("--entry", choices=("prefill", "step", "mtp"), default="step")
    i.add_argument("--batch", type=int, default=1, help="rows (cohort size); prefill needs 1")
    i.add_argument("--tokens", type=int, default=1, help="tokens per row (1 = decode, K+1 = verify)")
    i.add_argument("--act", choices=("f32", "bf16"), default="bf16", help="activation dtype")
    i.add_argument("--kv", choices=("int8", "bf16", "f32"), default=None, help="KV cache dtype (default: the spec's)")
    i.add_argument("--max-context", type=positive_int, default=None, help="tokens per sequence (default: the spec's)")
    i.add_argument("--stats", action="store_true", help="print equation counts instead of the graph")
    i.add_argument("--plan", action="store_true", help="print the lowered plan: every kernel call with its launch "
                   "and a binding per parameter (after the pass pipeline)")
    i.add_argument("--target", default=None, help="--plan: card (default rtx3090)")
    i.add_argument("--arch", default=None, help="--plan: sm_80 | sm_86 | sm_87 | sm_89 | sm_90 (wins over --target)")
    i.set_defaults(func=cmd_inspect)
    add_run_parser(sub)
    dv = sub.add_parser("draft-vocab", help="rank the N most frequent tokens of text files: a reduced draft vocabulary",
                        description="Tokenizes the files with the model's tokenizer, counts every token and writes "
                        "the N most frequent ids (ties: lower id first) as draft_vocab.json, which `run "
                        "--draft-vocab` and `load(draft_vocab=...)` read. Draft from text like what you will serve.")
    dv.add_argument("files", nargs="+", help="text files or folders (folders: every *.py, *.md, *.txt, *.json below)")
    dv.add_argument("--weights", default=None, help="the model whose tokenizer to use (default: the shipped small model)")
    dv.add_argument("--size", type=int, required=True, help="N: how many token ids to keep")
    dv.add_argument("--out", required=True, help="where to write the JSON file")
    dv.set_defaults(func=cmd_draft_vocab)
    bn = sub.add_parser("bench", help="GPU benchmark: TTFT, decode and prefill speed, bandwidth efficiency, memory",
                        description="Runs the reference workload on the GPU backend: ~30-token prompts with "
                        "1024 greedy output tokens (one request), then long prompts (8K, 32K). Prints a table "
                        "and writes JSON; bandwidth efficiency is against a copy measured in the same run.")
    _bench_arguments(bn)
    bn.set_defaults(func=cmd_bench)
    cv = sub.add_parser("convert", help="quantise an HF checkpoint once into a container that loads at disk speed",
                        description=CONVERT_DESCRIPTION)
    cv.add_argument("source", help="HF checkpoint directory (config.json + safetensors)")
    cv.add_argument("out", help="container folder to create (must not exist, or be empty; see --force)")
    cv.add_argument("--spec", default=None, help="spec YAML whose quantisation recipe to apply (default: the "
                    "spec derived from config.json, with the default recipe)")
    cv.add_argument("--device", default=None, help="where to quantise: cuda or cpu (default: cuda when available)")
    cv.add_argument("--shard-size", default="4GiB", help="largest shard file (default 4GiB)")
    cv.add_argument("--force", action="store_true", help="replace an existing container folder")
    cv.set_defaults(func=cmd_convert)
    __import__("ninfer_gen.cli.serve", fromlist=["add_serve_parser"]).add_serve_parser(sub)
    return p


def _bench_arguments(p) -> None:
    p.add_argument("spec", nargs="?", default="model_specs/qwen3.8-27b.yaml",
                   help="model spec YAML; its weights are drawn on the GPU in the spec's formats (default: 27B); the "
                   "cohort bench also takes a checkpoint or converted folder here")
    p.add_argument("--weights", default=None, help="an HF checkpoint directory instead of random weights")
    p.add_argument("--prompt-tokens", type=positive_int, default=30, help="short prompt length (default 30)")
    p.add_argument("--output-tokens", type=positive_int, default=1024, help="greedy tokens per request (default 1024)")
    p.add_argument("--repeats", type=positive_int, default=2, help="requests of the short workload (median reported)")
    p.add_argument("--prefill", default="8192,32768", help="long prompt lengths, comma separated ('' = none)")
    p.add_argument("--vram-budget", default="24GiB", help="memory budget, enforced on the allocator (default 24GiB)")
    p.add_argument("--hf-json", default=None, help="lab/hf_baseline.py output for same-day ratios")
    p.add_argument("--json", default=None, help="write the full results here")
    p.add_argument("--draft", type=int, default=None, help="also time C1 speculative rounds with K MTP drafts beside "
                   "plain decode (default 0: plain decode only; the cohort bench's K, default 3)")
    p.add_argument("--accept-prob", type=float, default=None, help="bench only: keep each draft with this "
                   "probability (a coin per position until the first failure) instead of comparing it with the "
                   "target: random weights draft at random")
    p.add_argument("--per-k", action="store_true", help="with --draft K: also run the request at every K' from 1 to K "
                   "in the K-bucket (a lane's own K; tokens per round and acceptance per K')")
    p.add_argument("--state-mode", choices=("replayssm", "snapshot"), default="replayssm",
                   help="with --draft: ReplaySSM (records; rounds timed fused and eager) or the "
                   "snapshot design (K+1 GDN state copies per lane; fused rounds), for comparison")
    p.add_argument("--arch-path", default=None, metavar="CARD|sm_XX", help="run another card's code path as compute_XX "
                   "PTX the driver JIT-compiles on this GPU: rtx3090 builds the RTX 3090's kernels exactly (no PDL, "
                   "no warpgroup MMA, grids for its 82 SMs); sm_86 the same arch's code with grids sized for this "
                   "GPU's SMs (default: the GPU's own arch)")
    p.add_argument("--draft-vocab", default=None, help="with --draft: a draft_vocab.json, or a number N — bench only: "
                   "the first N token ids (random weights have no frequent tokens) — for a reduced MTP head")
    p.add_argument("--tp", type=int, default=1, help="engine benches: tensor parallel over N rank processes (gloo, "
                   "reference backend; default 1)")
    p.add_argument("--no-vision", action="store_true", help="load the model as text only: without its vision tower "
                   "and vision section (saves its memory and, on the GPU, the M-RoPE buckets; images are refused)")
    from ninfer_gen.cli.run import add_vision_kernels
    add_vision_kernels(p)
    from ninfer_gen.cli.bench_cohort import add_arguments as add_cohort_arguments
    add_cohort_arguments(p)
    from ninfer_gen.cli.bench_long import add_arguments as add_long_arguments
    add_long_arguments(p)


def cmd_bench(args) -> int:
    if args.long_context:
        from ninfer_gen.cli.bench_long import cmd_bench_long
        return cmd_bench_long(args)
    if args.tp > 1:
        from ninfer_gen.cli.ranks import in_rank, launch_command, reference_backend
        if not (args.concurrency or args.workload or args.long_prompt is not None):
            raise ValueError(f"--tp {args.tp}: the engine benches (--concurrency, --long-prompt, --workload agent) run "
                             "on the reference backend's ranks; the single-request GPU bench has no --tp")
        reference_backend(args, "bench")
        if not in_rank():
            return launch_command(args)
    if args.workload == "agent":
        from ninfer_gen.cli.bench_agent import cmd_bench_agent
        return cmd_bench_agent(args)
    if args.concurrency or args.long_prompt is not None:
        from ninfer_gen.cli.bench_cohort import cmd_bench_cohort
        return cmd_bench_cohort(args)
    from ninfer_gen.cli.bench import cmd_bench as run_bench_command
    args.draft = args.draft or 0
    return run_bench_command(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)     # `--tp` runs the same command in each rank
    args.cli_main = main                                          # ... through this entry (cli.ranks)
    try:
        return args.func(args)
    except (SpecError, ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
