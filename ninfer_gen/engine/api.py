"""api: the public Python entry — `load()` and the `Model` it returns (forward_logits, generate,
mtp_logits, text generation). Chooses weights (checkpoint, spec + random, or the shipped small model)
and the backend; it computes nothing itself."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from compiler.options import CompileOptions
from compiler.schema import SpecError
from compiler.spec import ModelSpec, load_spec

from ninfer_gen.weights.random_weights import random_weights
from ninfer_gen.reference import ReferenceBackend
from ninfer_gen.engine.sampling import Sampler, SamplingParams
from ninfer_gen.engine.speculative import Stats, speculative_stream
from ninfer_gen.engine.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]          # ninfer_gen/engine/api.py → the repository
DEFAULT_MODEL = REPO / "models" / "qwen3.8-small-py"
TINY_SPEC = REPO / "model_specs" / "qwen3.8-tiny.yaml"
BACKENDS = ("reference", "gpu")
GREEDY_WINDOW = 16      # greedy tokens per host round trip on backends with a device loop (Model.stream)


class Model:
    def __init__(self, spec: ModelSpec, backend: ReferenceBackend, folder: Path | None = None,
                 source: str = ""):
        self.spec, self.backend, self.source = spec, backend, source
        self.tokenizer = load_tokenizer(folder, spec.model.vocab_size)
        self.eos_ids = _eos_ids(folder)

    def forward_logits(self, token_ids: list[int], chunk_size: int | None = None) -> np.ndarray:
        """Logits [T, vocab] of a fresh sequence (chunked prefill)."""
        seq = self.backend.new_sequence()
        try:
            logits, _ = self.backend.prefill(seq, list(token_ids), chunk_size, all_logits=True)
        finally:
            self.backend.release(seq)
        return logits.float().cpu().numpy()

    def mtp_logits(self, token_ids: list[int], chunk_size: int | None = None) -> np.ndarray:
        """MTP predictions [T, vocab]: row i predicts token i+2 from hidden y_i and the true token
        i+1; the last row uses the main model's own argmax as the next token (as drafting does)."""
        if not self.spec.model.mtp.num_layers:
            raise ValueError(f"model {self.spec.name} has no MTP layer")
        ids = list(token_ids)
        seq = self.backend.new_sequence()
        try:
            logits, hidden = self.backend.prefill(seq, ids, chunk_size)
            next_ids = ids[1:] + [int(torch.argmax(logits[-1]))]
            mtp, _ = self.backend.mtp(seq, hidden, next_ids, 0, chunk_size)
        finally:
            self.backend.release(seq)
        return mtp.float().cpu().numpy()

    def speculative(self, draft: int) -> bool:
        """Whether `draft` > 0 drafts can run here; a ValueError says why not."""
        if draft <= 0:
            return False
        if not self.spec.model.mtp.num_layers:
            raise ValueError(f"model {self.spec.name} has no MTP layer to draft with: use --draft 0")
        if not hasattr(self.backend, "verify"):
            raise ValueError(f"speculative decoding is not available on the {type(self.backend).__name__}: "
                             "use --draft 0")
        built = getattr(self.backend, "drafts", None)
        if built is not None and draft not in built:
            raise ValueError(f"this {type(self.backend).__name__} was built for {', '.join(map(str, built)) or 'no'} "
                             f"drafts per round, not {draft}: load it with that draft length (the spec's "
                             "runtime.draft_tokens)")
        return True

    def stream(self, token_ids: list[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
               stop_tokens: set[int] | None = None, draft: int = 0, stats: Stats | None = None) -> Iterator[int]:
        """Yields new tokens one by one: prefill, then one `step` (B=1, T=1) per token, or with `draft`
        K > 0 speculative rounds of K MTP drafts (engine.speculative; `stats` collects acceptance).
        Greedy decoding without drafts on a backend with a device loop (`greedy`, the GPU) runs the steps
        in windows of GREEDY_WINDOW tokens with one host round trip per window; a stop token ends the
        stream at once (the rest of its window was computed and is dropped with the sequence)."""
        if max_new_tokens <= 0:
            return
        if self.speculative(draft):
            rounds = getattr(self.backend, "device_rounds", None)        # the GPU's one-graph rounds
            if rounds is not None:
                yield from rounds.stream(list(token_ids), max_new_tokens, sampling, stop_tokens, stats)
            else:
                yield from speculative_stream(self.backend, list(token_ids), max_new_tokens, draft, sampling,
                                              stop_tokens, stats)
            return
        sample = Sampler(sampling)
        seq = self.backend.new_sequence()
        device_loop = sampling.greedy and hasattr(self.backend, "greedy")
        try:
            logits, _ = self.backend.prefill(seq, list(token_ids))
            token, produced = sample(logits[-1]), 1
            yield token
            while produced < max_new_tokens and not (stop_tokens and token in stop_tokens):
                room = self.backend.max_context - seq.length
                if room <= 0:
                    return
                if device_loop:
                    n = min(GREEDY_WINDOW, max_new_tokens - produced, room)
                    window = self.backend.greedy(seq, token, n)
                else:
                    logits, _ = self.backend.run("step", [seq], [[token]])
                    window = [sample(logits[-1])]
                for token in window:
                    produced += 1
                    yield token
                    if stop_tokens and token in stop_tokens:
                        return
        finally:
            self.backend.release(seq)

    def generate(self, token_ids: list[int], max_new_tokens: int, greedy: bool = True,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop_tokens: set[int] | None = None, draft: int = 0) -> list[int]:
        """The new tokens only. Stops early only at `stop_tokens` (none by default); `draft` K > 0
        decodes speculatively with K MTP drafts per round."""
        params = SamplingParams(0.0 if greedy else temperature, top_k, top_p, seed)
        return list(self.stream(token_ids, max_new_tokens, params, stop_tokens, draft))


def _resolve_tokenizer(path=None):
    """(tokenizer, vocabulary size) of a model folder, a spec, or the shipped small model."""
    folder = Path(path) if path else (DEFAULT_MODEL if (DEFAULT_MODEL / "config.json").is_file() else None)
    if folder is not None and folder.is_dir():
        config = json.loads((folder / "config.json").read_text())
        vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
        return load_tokenizer(folder, vocab), vocab
    spec = load_spec(folder or TINY_SPEC)
    return load_tokenizer(None, spec.model.vocab_size), spec.model.vocab_size


def _eos_ids(folder: Path | None) -> set[int]:
    if folder is None:
        return set()
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids


def _resolve(path_or_spec, verify: bool = True, require_mtp: bool = False) -> tuple[ModelSpec, dict, Path | None, str]:
    if path_or_spec is None:
        if (DEFAULT_MODEL / "config.json").is_file():
            path_or_spec = DEFAULT_MODEL
        else:
            spec = load_spec(TINY_SPEC)
            return spec, random_weights(spec), None, f"{spec.name} (random weights, seed 0)"
    if isinstance(path_or_spec, ModelSpec):
        return path_or_spec, random_weights(path_or_spec), None, f"{path_or_spec.name} (random weights)"
    path = Path(path_or_spec)
    if path.is_dir():
        from ninfer_gen.weights.checkpoint import load_checkpoint
        from ninfer_gen.weights.container import is_container, load_host

        if is_container(path):
            spec, tensors = load_host(path, verify=verify, require_mtp=require_mtp)
            return spec, tensors, path, f"{path} (converted)"
        spec, tensors = load_checkpoint(path, require_mtp=require_mtp)
        return spec, tensors, path, str(path)
    if path.suffix in (".yaml", ".yml"):
        spec = load_spec(path)
        return spec, random_weights(spec), None, f"{spec.name} (random weights, seed 0)"
    raise SpecError("", f"{path}: expected an HF checkpoint directory, a converted container or a model spec "
                        ".yaml file")


def load(path_or_spec=None, backend: str = "reference", dtype: str = "float32", quantize: bool = False,
         device: str | None = None, kv_dtype: str | None = None, max_context: int | None = None,
         random_weights: str = "host", vram_budget: int | None = None, use_graphs: bool = True,
         progress: bool = False, options: CompileOptions | None = None, build_root=None,
         all_logits: bool = False, draft: int | None = None, round_mode: str = "fused", verify: bool = True,
         accept_coin: bool = False, draft_vocab=None, cohorts: int = 1, kv_pool_tokens: int | None = None,
         prefix_states: int = 0, tp: int = 1) -> Model:
    """Load a model. `path_or_spec`: an HF checkpoint directory, a container `ninfer-gen convert` wrote
    (its sha256 hashes checked unless `verify=False`), a spec .yaml (seeded random weights), a ModelSpec,
    or None for the small model shipped in the repository. With `draft` > 0 a checkpoint must have its
    MTP layer (else it loads without one).

    backend "reference": the graph interpreter in torch; `quantize=True` runs the spec's quantisation
    recipe at load and the reference uses the dequantised weights.
    backend "gpu": the compiled kernels; weights always take the spec's recipe (quantised at load).
    With a spec and `random_weights="device"`, the weights are drawn on the GPU directly in their
    quantised formats (any size, seconds; values differ from the host draw of the same seed); `options`
    (compiler.options.CompileOptions, default the shipped ones) and `build_root` (the kernel cache)
    choose what it compiles, `all_logits` keeps every prefill row's logits (`forward_logits`), `draft` the
    MTP drafts per speculative round it builds for (default: the spec's; the reference drafts any K),
    `round_mode` how it runs them: `fused` / `eager` one-graph rounds, or `host`-driven (the reference's way);
    `accept_coin` is the bench's (`--accept-prob`): it also builds rounds whose acceptance is a coin;
    `draft_vocab` (GPU): token ids, or a draft_vocab.json, the MTP drafts from (weights.draft_vocab);
    `cohorts` (GPU): the most sequences decoded together (the cohort engine's lanes, executor.gpu_lanes);
    `kv_pool_tokens` (GPU): one KV pool of that many tokens shared by them (default: cohorts × context);
    `prefix_states` (GPU): GDN states the prefix cache may keep in device memory (0: no prefix reuse);
    `tp` (reference): this process is one of `tp` ranks of a torch.distributed group (ninfer_gen.parallel
    launches them) and holds its share of the model (compiler.shard)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not available (available: {', '.join(BACKENDS)})")
    if tp > 1 and backend != "reference":
        raise ValueError(f"--tp {tp} runs on the reference backend (gloo); the GPU runtime over NCCL is not built yet")
    if random_weights not in ("host", "device"):
        raise ValueError(f"random_weights must be 'host' or 'device', got {random_weights!r}")
    if backend == "gpu":
        gpu = dict(options=options or CompileOptions(), build_root=build_root, all_logits=all_logits,
                   use_graphs=use_graphs, progress=progress, draft=draft, round_mode=round_mode,
                   accept_coin=accept_coin, draft_vocab=draft_vocab, cohorts=cohorts,
                   kv_pool_tokens=kv_pool_tokens, prefix_states=prefix_states)
        return _load_gpu(path_or_spec, kv_dtype, max_context, random_weights, vram_budget, gpu, verify)
    spec, tensors, folder, source = _resolve(path_or_spec, verify, bool(draft))
    if quantize:
        from ninfer_gen.weights.checkpoint import dequantized, quantize_weights
        from ninfer_gen.weights.container import is_container

        if not (folder and is_container(folder)):    # a container holds the recipe's formats already
            tensors = dequantized(quantize_weights(spec, tensors))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    rank_spec = spec
    if tp > 1:
        from compiler.shard import shard_spec, shard_weights
        from ninfer_gen.parallel import rank_of

        rank_spec, tensors = shard_spec(spec, tp), shard_weights(spec, tensors, tp, rank_of(tp))
    ref = ReferenceBackend(rank_spec, tensors, device=device, dtype=dtype, kv_dtype=kv_dtype, max_context=max_context)
    return Model(spec, ref, folder, source)


def _load_gpu(path_or_spec, kv_dtype, max_context, random_weights, vram_budget, gpu: dict, verify: bool) -> Model:
    if not torch.cuda.is_available():
        raise RuntimeError("the GPU backend needs a CUDA device; none is visible (use backend='reference')")
    from ninfer_gen.executor.device_weights import random_on_device
    from ninfer_gen.executor.gpu_backend import GpuBackend
    from ninfer_gen.executor.memory_plan import GiB

    budget = vram_budget or int(24 * GiB)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))   # the budget binds the allocator too
    if random_weights == "device" and (isinstance(path_or_spec, ModelSpec) or
                                       str(path_or_spec).endswith((".yaml", ".yml"))):
        spec = path_or_spec if isinstance(path_or_spec, ModelSpec) else load_spec(path_or_spec)
        weights = random_on_device(spec, seed=0, progress=gpu["progress"])
        folder, source = None, f"{spec.name} (random weights drawn on the GPU, seed 0)"
    else:
        spec, weights, folder, source = _device_weights(path_or_spec, gpu["progress"], verify, bool(gpu["draft"]))
    ids = gpu.pop("draft_vocab")
    if ids is not None and not isinstance(ids, (list, tuple)):
        from ninfer_gen.weights.draft_vocab import load as load_draft_vocab
        ids = load_draft_vocab(ids, spec.model.vocab_size)
    backend = GpuBackend(spec, weights, max_context=max_context, kv_dtype=kv_dtype, vram_budget=budget,
                         draft_vocab=list(ids) if ids is not None else None, **gpu)
    return Model(spec, backend, folder, source)


def _device_weights(path_or_spec, progress: bool, verify: bool, require_mtp: bool):
    """GPU weights: a container's planes copied as stored, an HF checkpoint streamed and quantised on the
    GPU one tensor at a time, or host tensors (random weights of a spec) quantised, then copied."""
    from ninfer_gen.executor.device_weights import from_checkpoint, from_container, from_host
    from ninfer_gen.weights.checkpoint import quantize_weights
    from ninfer_gen.weights.container import is_container

    path = DEFAULT_MODEL if path_or_spec is None and (DEFAULT_MODEL / "config.json").is_file() else path_or_spec
    if isinstance(path, (str, Path)) and Path(path).is_dir():
        path = Path(path)
        if is_container(path):
            weights = from_container(path, verify=verify, require_mtp=require_mtp, progress=progress)
            return weights.spec, weights, path, f"{path} (converted)"
        weights = from_checkpoint(path, require_mtp=require_mtp, progress=progress)
        return weights.spec, weights, path, str(path)
    spec, tensors, folder, source = _resolve(path_or_spec)
    return spec, from_host(spec, quantize_weights(spec, tensors), progress=progress), folder, source
