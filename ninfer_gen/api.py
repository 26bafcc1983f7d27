"""api: the composition root and public Python entry — `load()` with its `LoadOptions`, and the `Model` it
returns. Chooses weights (ninfer_gen.sources: checkpoint, container, GGUF, spec + random, or the shipped small
model) and the backend, and wires a
model's lane adapter (ninfer_gen.cohort) under the engine: `Model.generate` / `stream` are a one-lane
engine (ninfer_gen.engine), the same path as `run`, `bench` and `serve`. It computes nothing itself."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from compiler.options import CompileOptions
from compiler.spec import ModelSpec, load_spec

from ninfer_gen.reference import ReferenceBackend
from ninfer_gen.sampling import SamplingParams
from ninfer_gen.speculative import Stats
from ninfer_gen.engine.tokenizer import load_tokenizer
from ninfer_gen.sources import DEFAULT_MODEL, REPO, TINY_SPEC, device_weights, host_weights  # noqa: F401 (re-exported)

BACKENDS = ("reference", "gpu")


class Model:
    def __init__(self, spec: ModelSpec, backend: ReferenceBackend, folder: Path | None = None,
                 source: str = ""):
        self.spec, self.backend, self.source, self.folder = spec, backend, source, folder
        self.tokenizer = load_tokenizer(folder, spec.model.vocab_size)
        self.eos_ids = _eos_ids(folder)
        self._lanes = None                          # (options, the lane adapter): Model.lanes

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

    def lanes(self, lanes: int = 1, **options):
        """The model's lane adapter (ninfer_gen.cohort.cohort_lanes) of at least `lanes` lanes, made once and
        kept: the GPU's rounds and buffers belong to one adapter at a time."""
        from ninfer_gen.cohort import cohort_lanes

        key = tuple(sorted(options.items()))
        if self._lanes is not None:
            made, adapter = self._lanes
            if (not options or made == key) and adapter.capacity >= lanes:
                return adapter
        self._lanes = (key, cohort_lanes(self, lanes, **options))
        return self._lanes[1]

    # ------------------------------------------------------------ images (ninfer_gen.vision, compiler.multimodal)
    @property
    def vision(self) -> bool:
        """Whether this model takes images: a spec with a vision section and the tower's weights loaded."""
        if self.spec.vision is None:
            return False
        if isinstance(self.backend, ReferenceBackend):
            return "visual.pos_embed.weight" in self.backend.weights
        return self.backend.encoder is not None

    @property
    def image_config(self):
        """The model's image preprocessing: its folder's preprocessor_config.json, else Qwen3.5's defaults on the
        spec's patch grid (64 to 16,384 image tokens per image, as Qwen3.5's pixel bounds give on its grid)."""
        from ninfer_gen.vision.preprocess import ImageConfig

        path = self.folder / "preprocessor_config.json" if self.folder else None
        v = self.spec.vision
        if path is not None and path.is_file():
            config = ImageConfig.from_hf(json.loads(path.read_text()))
        elif v is None:
            return ImageConfig()
        else:
            factor = v.patch_size * v.spatial_merge_size
            config = ImageConfig(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                                 merge_size=v.spatial_merge_size, min_pixels=64 * factor ** 2,
                                 max_pixels=16384 * factor ** 2)
        if not isinstance(self.backend, ReferenceBackend) and self.backend.memory.vision_patches:
            most = self.backend.memory.vision_patches * config.patch_size ** 2     # the GPU: what its plan holds
            config = dataclasses.replace(config, max_pixels=max(config.min_pixels, min(config.max_pixels, most)))
        return config

    def check_vision(self) -> None:
        """Raises ValueError saying why this model takes no images (nothing when it does)."""
        if self.vision:
            return
        if self.spec.vision is None:
            raise ValueError(f"model {self.spec.name} has no vision tower: it takes text only")
        raise ValueError(f"model {self.spec.name} was loaded without its vision tower (--no-vision): it takes text only")

    def prepare_images(self, items, limits=None, config=None):
        """A request's images (encoded bytes or Pillow images, in prompt order) → the encoder's input
        (vision.preprocess.Processed). Raises ValueError (an ImageError names the image) for a model without a
        tower and for images beyond `limits` (vision.preprocess.ImageLimits; default limits)."""
        from ninfer_gen.vision.preprocess import ImageLimits, preprocess

        self.check_vision()
        limits = limits or ImageLimits()
        if limits.max_tokens is None:              # images that could never fit the context fail before patchifying
            limits = dataclasses.replace(limits, max_tokens=self.backend.max_context)
        return preprocess(list(items), config or self.image_config, limits)

    def expand_images(self, ids: list[int], images) -> list[int]:
        """Token ids with one image placeholder per image (as a chat template writes it) → the prompt the model
        runs: each placeholder repeated once per image token (`images`: prepare_images' result)."""
        from compiler.multimodal import expand_image_placeholders

        self.check_vision()
        return expand_image_placeholders(list(ids), list(images.tokens), self.spec.vision.image_token_id)

    def image_prompt(self, ids: list[int], images) -> list[int]:
        """`ids` with each image's full placeholder block in front (vision start, its image tokens, vision end),
        the images in order: a prompt for images without a chat template."""
        self.check_vision()
        v = self.spec.vision
        block = []
        for n in images.tokens:
            block += [v.vision_start_token_id] + [v.image_token_id] * n + [v.vision_end_token_id]
        return block + list(ids)

    def speculative(self, draft: int) -> bool:
        """Whether `draft` > 0 drafts can run here; a ValueError says why not."""
        if draft <= 0:
            return False
        if not self.spec.model.mtp.num_layers:
            raise ValueError(f"model {self.spec.name} has no MTP layer to draft with: use --draft 0")
        most = self.max_draft
        if draft > most:
            raise ValueError(f"this {type(self.backend).__name__} runs at most {most} drafts per round, not {draft} "
                             "(a GPU backend is built for the spec's runtime.draft_tokens, or load(draft=K))")
        return True

    @property
    def max_draft(self) -> int:
        """The largest K a request may ask: the GPU backend's built K, any reasonable K on the reference."""
        from ninfer_gen.lanes.reference import MAX_DRAFT

        if not self.spec.model.mtp.num_layers:
            return 0
        if isinstance(self.backend, ReferenceBackend):
            return MAX_DRAFT
        profile = self.backend.profile                          # the GPU backend's runtime profile
        return profile.draft if profile.speculative else 0

    def stream(self, token_ids: list[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
               stop_tokens: set[int] | None = None, draft: int = 0, stats: Stats | None = None,
               adaptive_draft: bool = False, images=None) -> Iterator[int]:
        """Yields new tokens as a one-lane engine makes them (prefill, then plain steps or, with `draft` K > 0,
        speculative rounds of K MTP drafts; `adaptive_draft`: plain steps once drafts stop paying, engine.Engine);
        `stats` collects rounds, drafts and acceptance. `images` (prepare_images): the prompt's images, whose
        placeholders `token_ids` holds expanded (expand_images, image_prompt)."""
        from ninfer_gen.engine import Engine, Request

        if max_new_tokens <= 0:
            return
        self.speculative(draft)
        lanes = self.lanes(1) if self._lanes is not None else self.lanes(1, prefix_cache=0)   # no cache of its own
        engine = Engine(lanes, lanes=1, max_queue=0, adaptive_draft=adaptive_draft)
        if images is not None:
            self.check_vision()
        handle = engine.submit(Request(list(token_ids), max_new_tokens, sampling, frozenset(stop_tokens or ()), draft,
                                       images=images))
        try:
            for event in handle:
                yield from event.tokens
                if event.finish == "error":
                    raise RuntimeError(event.error)
                if event.finish is not None and stats is not None:
                    s = event.stats
                    stats.rounds, stats.drafted, stats.accepted = s.rounds, s.drafted, s.accepted
                    stats.emitted = s.tokens - 1
        finally:
            if handle.final is None:                # the caller stopped reading: free the lane now
                engine.cancel(handle.id)
                engine.step()

    def generate(self, token_ids: list[int], max_new_tokens: int, greedy: bool = True,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop_tokens: set[int] | None = None, draft: int = 0, images=None) -> list[int]:
        """The new tokens only. Stops early only at `stop_tokens` (none by default); `draft` K > 0
        decodes speculatively with K MTP drafts per round; `images` as in `stream`."""
        params = SamplingParams(0.0 if greedy else temperature, top_k, top_p, seed)
        return list(self.stream(token_ids, max_new_tokens, params, stop_tokens, draft, images=images))


def resolve_tokenizer(path=None):
    """(tokenizer, vocabulary size) of a model folder, a GGUF, a spec, or the shipped small model."""
    from ninfer_gen.weights.gguf_load import folder_of, is_gguf, open_gguf
    if path and is_gguf(path):
        g = open_gguf(path)
        return load_tokenizer(folder_of(g), g.spec.model.vocab_size), g.spec.model.vocab_size
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


@dataclass(frozen=True)
class LoadOptions:
    """How `load()` builds a model: every choice in one validated object (`load(path, LoadOptions(...))`, or
    its fields as keywords: `load(path, backend="gpu", cohorts=8)`)."""
    backend: str = "reference"          # "reference": the graph interpreter in torch; "gpu": the compiled kernels
    dtype: str = "float32"              # reference activations
    quantize: bool = False              # reference: run the spec's recipe at load, then the dequantised weights
    device: str | None = None           # reference: cpu or cuda (default: cuda when available)
    kv_dtype: str | None = None         # default: the spec's (int8)
    max_context: int | None = None      # tokens per sequence (default: the spec's)
    random_weights: str = "host"        # a spec's random weights: drawn on the "host", or on the GPU ("device")
    vram_budget: int | None = None      # GPU: bytes the memory plan may use (default 24 GiB, the RTX 3090)
    use_graphs: bool = True             # GPU: replay CUDA graphs (False: launch eagerly, for debugging)
    progress: bool = False              # progress bars for weights and kernels
    compile_options: CompileOptions | None = None    # GPU: what the compiler builds (default: the shipped)
    build_root: Any = None              # GPU: the kernel cache (default: build/)
    all_logits: bool = False            # GPU: prefill buckets keep every row's logits (forward_logits at speed)
    draft: int | None = None            # GPU: the largest K its rounds are built for (default: the spec's)
    state_mode: str = "replayssm"       # GPU: "snapshot" builds rounds in the K+1-copies design (comparison)
    verify: bool = True                 # a converted container: check its sha256 hashes
    accept_coin: bool = False           # GPU, bench only: also build rounds whose acceptance is a coin
    draft_vocab: Any = None             # GPU: token ids (or a draft_vocab.json) the MTP drafts from
    cohorts: int = 1                    # GPU: the most sequences decoded together (the engine's lanes)
    kv_pool_tokens: int | None = None   # GPU: one KV pool of that many tokens shared by the lanes
    prefix_states: int = 0              # GPU: GDN states the prefix cache may keep in device memory
    tp: int = 1                         # reference: this process is one of `tp` tensor-parallel ranks
    arch_path: str | None = None        # GPU: run another arch's code path (e.g. "sm_86" PTX on an sm_90 card)
    vision: bool = True                 # load the vision tower; False: a text model (no tower, no vision
                                        # section: images are refused)
    vision_patches: int = 4096          # GPU: the largest image the memory plan holds, in patches (larger ones are
                                        # resized down to it: executor.vision_encoder.DEFAULT_PATCHES)
    vision_kernels: bool = False        # GPU: run the tower on the compiler's encoder plans (executor.vision_plan;
                                        # they pass the GPU tier, speed not yet measured; the memory plan counts
                                        # their packed weights and arena) instead of torch

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is not available (available: {', '.join(BACKENDS)})")
        if self.tp > 1 and self.backend != "reference":
            raise ValueError(f"--tp {self.tp} runs on the reference backend (gloo); the GPU runtime over NCCL is "
                             "not built yet")
        if self.random_weights not in ("host", "device"):
            raise ValueError(f"random_weights must be 'host' or 'device', got {self.random_weights!r}")
        if self.state_mode not in ("replayssm", "snapshot"):
            raise ValueError(f"state_mode must be 'replayssm' or 'snapshot', got {self.state_mode!r}")
        if self.cohorts < 1:
            raise ValueError(f"cohorts must be ≥ 1, got {self.cohorts}")
        if self.draft is not None and self.draft < 0:
            raise ValueError(f"draft must be ≥ 0, got {self.draft}")
        if self.arch_path is not None and self.backend != "gpu":
            raise ValueError(f"arch_path {self.arch_path!r} chooses the GPU's code path: use it with backend 'gpu'")
        if not isinstance(self.vision, bool):
            raise ValueError(f"vision must be True or False, got {self.vision!r}")
        if self.vision_kernels and (self.backend != "gpu" or not self.vision):
            raise ValueError("vision_kernels runs the vision tower's compiled plans: use it with backend 'gpu' and "
                             "the tower loaded (not with --no-vision)")
        if self.vision_patches < 64:
            raise ValueError(f"vision_patches must be ≥ 64 (an image of at least 8×8 patches), got {self.vision_patches}")


def load(path_or_spec=None, opts: LoadOptions | None = None, /, **fields) -> Model:
    """Load a model. `path_or_spec`: an HF checkpoint directory, a container `ninfer-gen convert` wrote
    (its sha256 hashes checked unless `verify=False`), a spec .yaml (seeded random weights), a ModelSpec,
    or None for the small model shipped in the repository. `opts` (LoadOptions) and/or its fields as keywords
    say how. With `draft` > 0 a checkpoint must have its MTP layer (else it loads without one).
    On the GPU the weights always take the spec's recipe (quantised at load); with a spec and
    random_weights="device" they are drawn on the GPU directly (any size, seconds; values differ from the
    host draw of the same seed). A model with a vision tower loads it (on the GPU beside the text model's planes,
    run in torch: executor.vision_encoder); `vision=False` loads it as a text model (no tower, no vision section)."""
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(LoadOptions)})
    if unknown:
        raise ValueError(f"load() has no option {', '.join(map(repr, unknown))} (LoadOptions lists them)")
    o = dataclasses.replace(opts or LoadOptions(), **fields)
    if o.backend == "gpu":
        return _load_gpu(path_or_spec, o)
    draft, verify, quantize, tp = o.draft, o.verify, o.quantize, o.tp
    spec, tensors, folder, source = host_weights(path_or_spec, verify, bool(draft), o.vision)
    if quantize:
        from ninfer_gen.weights.checkpoint import dequantized, quantize_weights
        from ninfer_gen.weights.container import is_container

        from ninfer_gen.weights.gguf_load import is_gguf
        stored = isinstance(path_or_spec, (str, Path)) and is_gguf(path_or_spec)    # a GGUF keeps its formats
        if not (folder and is_container(folder)) and not stored:  # a container holds the recipe's formats already
            tensors = dequantized(quantize_weights(spec, tensors))
    device = o.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rank_spec = spec
    if tp > 1:
        from compiler.shard import shard_spec, shard_weights
        from ninfer_gen.parallel import rank_of

        rank_spec, tensors = shard_spec(spec, tp), shard_weights(spec, tensors, tp, rank_of(tp))
    ref = ReferenceBackend(rank_spec, tensors, device=device, dtype=o.dtype, kv_dtype=o.kv_dtype,
                           max_context=o.max_context)
    return Model(spec, ref, folder, source)


def _load_gpu(path_or_spec, o: LoadOptions) -> Model:
    if not torch.cuda.is_available():
        raise RuntimeError("the GPU backend needs a CUDA device; none is visible (use backend='reference')")
    from ninfer_gen.executor.device_weights import random_on_device
    from ninfer_gen.executor.gpu_backend import GpuBackend
    from ninfer_gen.executor.memory_plan import GiB

    budget = o.vram_budget or int(24 * GiB)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))   # the budget binds the allocator too
    if o.random_weights == "device" and (isinstance(path_or_spec, ModelSpec) or
                                         str(path_or_spec).endswith((".yaml", ".yml"))):
        from ninfer_gen.weights.tower import random_tower
        spec = path_or_spec if isinstance(path_or_spec, ModelSpec) else load_spec(path_or_spec)
        spec = spec if o.vision else dataclasses.replace(spec, vision=None)
        weights = random_on_device(spec, seed=0, progress=o.progress)            # the text model's only
        tower = random_tower(spec) if spec.vision is not None else None
        folder, source = None, f"{spec.name} (random weights drawn on the GPU, seed 0)"
    else:
        spec, weights, tower, folder, source = device_weights(path_or_spec, o.progress, o.verify, bool(o.draft),
                                                               o.vision)
    ids = o.draft_vocab
    if ids is not None and not isinstance(ids, (list, tuple)):
        from ninfer_gen.weights.draft_vocab import load as load_draft_vocab
        ids = load_draft_vocab(ids, spec.model.vocab_size)
    backend = GpuBackend(spec, weights, max_context=o.max_context, kv_dtype=o.kv_dtype, vram_budget=budget,
                         draft_vocab=list(ids) if ids is not None else None,
                         options=o.compile_options or CompileOptions(), build_root=o.build_root,
                         all_logits=o.all_logits, use_graphs=o.use_graphs, progress=o.progress, draft=o.draft,
                         round_mode="snapshot" if o.state_mode == "snapshot" else "fused",
                         accept_coin=o.accept_coin, cohorts=o.cohorts, kv_pool_tokens=o.kv_pool_tokens,
                         prefix_states=o.prefix_states, arch_path=o.arch_path, vision=tower,
                         vision_patches=o.vision_patches, vision_kernels=o.vision_kernels)
    return Model(spec, backend, folder, source)
