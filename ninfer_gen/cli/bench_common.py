"""bench_common: what the engine benches (bench_cohort, bench_interference, bench_agent) share — the backend
choice and the model load, an engine stepped by hand with every token arrival stamped, peak memory of a timed
run, nearest-rank percentiles, option lists, the device name and the PNG line plot. Computes no workload
and reports none; torch and matplotlib are imported only when a bench runs."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

GiB, MiB = 2 ** 30, 2 ** 20


def int_list(text: str, option: str) -> list[int]:
    """`--option 1,2,4`: positive integers."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{option}: expected a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{option}: expected positive integers, got {text!r}")
    return values


def pick_backend(args) -> str:
    """--backend auto|gpu|reference → gpu or reference (auto: gpu when a CUDA device is visible)."""
    import torch

    backend = args.backend if args.backend != "auto" else "gpu" if torch.cuda.is_available() else "reference"
    if backend == "gpu" and not torch.cuda.is_available():
        raise RuntimeError("--backend gpu needs a CUDA GPU; none is visible (--backend reference runs on the CPU)")
    return backend


def load_model(args, backend: str, k: int, lanes: int, context: int, pool: int, prefix_states: int = 0):
    """The bench's model: `--weights` or the spec (random weights; on the GPU drawn on the device), built for
    K drafts, `lanes` lanes of `context` tokens and (GPU) a shared KV pool of `pool` tokens and the GDN
    states of `prefix_states` prefix checkpoints in its memory plan."""
    import ninfer_gen

    source = args.weights or args.spec
    if backend == "reference":
        fits_host(source)
        return ninfer_gen.load(source, backend="reference", device="cpu", max_context=context, draft=k,
                               tp=getattr(args, "tp", 1), vision=not getattr(args, "no_vision", False),
                               vision_kernels=getattr(args, "vision_kernels", False))
    from ninfer_gen.cli.env import build_root, compile_options
    from ninfer_gen.executor.memory_plan import parse_bytes

    return ninfer_gen.load(source, backend="gpu", max_context=context, vram_budget=parse_bytes(args.vram_budget),
                           random_weights="device", progress=True, compile_options=compile_options(), build_root=build_root(),
                           draft=k, accept_coin=args.accept_prob is not None, draft_vocab=draft_vocab_arg(args),
                           cohorts=lanes, kv_pool_tokens=pool, prefix_states=prefix_states,
                           arch_path=getattr(args, "arch_path", None), vision=not getattr(args, "no_vision", False),
                           vision_kernels=getattr(args, "vision_kernels", False))


def fits_host(source) -> None:
    """A spec's random fp32 weights must fit in half the host's memory (the 27B default does not)."""
    if not str(source).endswith((".yaml", ".yml")):
        return
    from compiler.sizes import summary
    from compiler.spec import load_spec

    params = summary(load_spec(source))["parameters"]
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 4 * params > total // 2:
        raise ValueError(f"{source}: {params / 1e9:.1f} B parameters in fp32 ({4 * params / GiB:.0f} GiB) do not fit "
                         f"the reference backend on this machine ({total / GiB:.0f} GiB): give the small model "
                         "(models/qwen3.8-small-py) or a smaller spec")


def lane_tokens(tokens: int) -> int:
    """A lane's share of a shared KV pool: its tokens rounded up to whole pages of any size dividing 256."""
    return -(-tokens // 256) * 256


def device_name(backend: str) -> str:
    import torch

    if backend == "gpu":
        return torch.cuda.get_device_name()
    from ninfer_gen.cli.ranks import in_rank

    ranks = f" in each of {torch.distributed.get_world_size()} tensor-parallel ranks (gloo)" if in_rank() else ""
    return f"CPU, {torch.get_num_threads()} torch threads{ranks}"


class Memory:
    """Peak memory of one timed run: on the GPU torch's allocator peak and the device's used bytes (every
    process and context; sampled every 16 steps and at the end); on the CPU the resident set's high-water
    mark (VmHWM, reset through /proc/self/clear_refs where allowed, else VmRSS sampled the same way)."""

    def __init__(self, gpu: bool):
        self.gpu, self.peak, self.hwm = gpu, 0, False

    def reset(self) -> None:
        import torch

        self.peak = 0
        if self.gpu:
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm = True
        except OSError:
            self.hwm = False

    def sample(self) -> None:
        import torch

        if self.gpu:
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
        else:
            self.peak = max(self.peak, _status("VmHWM" if self.hwm else "VmRSS"))

    def figures(self) -> dict:
        import torch

        self.sample()
        if self.gpu:
            return {"allocator_peak_bytes": torch.cuda.max_memory_allocated(),
                    "allocator_reserved_peak_bytes": torch.cuda.max_memory_reserved(),
                    "device_used_peak_bytes": self.peak}
        return {"host_peak_rss_bytes": self.peak, "method": "VmHWM" if self.hwm else "VmRSS sampled"}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


MEMORY_HEAD_GPU = "peak alloc / reserved / device GiB"


def memory_text(m: dict) -> str:
    """A Memory's figures for a table cell: GiB allocated / reserved by the allocator / used on the device (what the
    allocator does not hold — CUDA context, module images — is device − reserved) on the GPU, MiB peak RSS on the
    CPU."""
    if "allocator_peak_bytes" in m:
        reserved = m.get("allocator_reserved_peak_bytes")
        return (f"{m['allocator_peak_bytes'] / GiB:.2f} / " + (f"{reserved / GiB:.2f} / " if reserved else "— / ")
                + f"{m['device_used_peak_bytes'] / GiB:.2f}")
    return f"{m['host_peak_rss_bytes'] / MiB:,.0f}"


def plan_weight_bytes(plan) -> int:
    """Packed weight bytes a plan's matrix multiplies read (a launch chain's members included)."""
    from compiler.kernels import matmul_keys
    from compiler.kernels.weight_layout import device_bytes

    return sum(device_bytes(k.fmt, k.n, k.k) for c in plan.calls for k in matmul_keys(c.key))


def step_bytes(spec, plan, context: int, kv_dtype: str) -> dict[str, int]:
    """Bytes one decode step must move: packed weights of every GEMV, the embedding row, GDN state
    read + written and conv history, KV of `context` tokens read per attention layer."""
    a, g, at = spec.model, spec.model.linear_attention, spec.model.attention
    weights = plan_weight_bytes(plan)
    n_gdn = sum(k == "linear_attention" for k in a.layers.kinds)
    n_attn = a.layers.count - n_gdn
    b = plan.graph.params["batch"]
    state = b * n_gdn * (2 * g.num_value_heads * g.key_head_dim * g.value_head_dim * 4
                         + 2 * (g.conv_kernel - 1) * g.conv_dim * 2)
    per_token = 2 * at.num_kv_heads * at.head_dim * ((1 + 2 / 64) if kv_dtype == "int8" else 2)
    kv = int(b * n_attn * context * per_token)
    return {"weights": weights, "state": state, "kv": kv, "total": weights + state + kv}


def gdn_state_per_lane(model, k: int) -> dict[str, int]:
    """The GDN state bytes one lane of a GPU model holds for rounds of K drafts: its committed state and its share of
    the ReplaySSM records (one row per lane of the largest cohort), against the snapshot design's committed state and
    K + 1 snapshots (the state after each token of the verify: compiler.sizes, as the memory plan counts them). Both
    are sized by K, not by what a round accepts; a prefix checkpoint is one committed state in either design."""
    from compiler.sizes import snapshot_bytes_per_token, summary

    be = model.backend
    state = summary(model.spec)["gdn_state_bytes_per_sequence"]
    records = sum(t.numel() * t.element_size() for store in (be.state.records, be.state.records1)
                  for layer in store.values() for t in layer.values()) // max(be.profile.cohorts)
    return {"committed": state, "verify_buffers": records, "total": state + records,
            "snapshot_total": state + (k + 1) * snapshot_bytes_per_token(model.spec)}


def draft_vocab_arg(args):
    """--draft-vocab: a draft_vocab.json, or N (bench only: the first N ids, labelled in the output)."""
    value = getattr(args, "draft_vocab", None)
    if value is None:
        return None
    return list(range(int(value))) if str(value).isdigit() else value


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    """n seeded random token ids (the benches' prompts with random weights)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def engine_run(lanes, prompt: list[int], tokens: int, draft: int) -> dict:
    """One greedy request alone through a one-lane engine over `lanes` (the path `run` and `serve` take):
    TTFT, decode and end-to-end tok/s, rounds, acceptance, ms per decode round."""
    from ninfer_gen.engine import Engine, Request

    engine = Engine(lanes, lanes=1, max_queue=0)
    final = engine.submit(Request(prompt, tokens, draft=draft)).result()
    if final.finish == "error":
        raise RuntimeError(f"the bench's request failed: {final.error}")
    s = final.stats
    return {"ttft_ms": s.ttft_s * 1e3, "decode_tok_s": s.decode_tok_s, "e2e_tok_s": s.tokens / (s.ttft_s + s.decode_s),
            "tokens": s.tokens, "rounds": s.rounds, "tokens_per_round": s.tokens_per_round,
            "acceptance": s.acceptance, "round_ms": s.decode_s / s.rounds * 1e3 if s.rounds else 0.0,
            "final_context": len(prompt) + s.tokens}


class Driver:
    """Steps an engine by hand and stamps every token arrival: per handle, (time, step, tokens) after the
    step that sent them."""

    def __init__(self, engine, memory: Memory):
        self.engine, self.memory, self.steps, self.arrivals = engine, memory, 0, {}

    def submit(self, request):
        handle = self.engine.submit(request)
        self.arrivals[handle] = []
        return handle

    def step(self) -> bool:
        worked = self.engine.step()
        now, self.steps = time.perf_counter(), self.steps + 1
        for handle, stamps in self.arrivals.items():
            n = sum(len(e.tokens) for e in handle.poll())
            if n:
                stamps.append((now, self.steps, n))
        if self.steps % 16 == 0:
            self.memory.sample()
        return worked

    def finals(self, handles) -> list:
        out = [h.result() for h in handles]
        bad = [f for f in out if f.finish == "error"]
        if bad:
            raise RuntimeError(f"a request of the bench failed: {bad[0].error}")
        return out


def pct(values: list[float], q: float) -> float:
    """The q-quantile by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def line_plot(path: Path, lines: list[tuple], *, xlabel: str, ylabel: str, title: str, xticks: list[int],
              log2_x: bool = False, log_y: bool = False) -> None:
    """A PNG of `lines`, each (label, xs, ys, style, group): the lines of one group share a colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours: dict = {}
    for label, xs, ys, style, group in lines:
        line, = ax.plot(xs, ys, style, label=label, color=colours.get(group))
        colours.setdefault(group, line.get_color())
    if log2_x:
        ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_xticks(xticks, [str(x) for x in xticks])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(result: dict, json_path: str | None, plot) -> None:
    """--json: the result as JSON, with `plot(result, png)` beside it (its path in the result's `plot`) when
    `plot` is given. Of `--tp` ranks, rank 0 writes."""
    from ninfer_gen.cli.ranks import is_lead

    if not json_path or not is_lead():
        return
    path = Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if plot is not None:
        result["plot"] = str(path.with_suffix(".png"))
        plot(result, Path(result["plot"]))
    path.write_text(json.dumps(result, indent=2))
