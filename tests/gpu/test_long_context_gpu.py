"""GPU tier at long context (issue 31): the paged kernels keyed as the 128K profile builds them (a 2,048-page
block table) against their references at positions past 32,768 and 100,000 — qk_rope_kv (RoPE + the INT8
append), attn_decode + attn_combine for a decode row and a verify's 4 rows (and the shared-memory ring against
the direct loads, the keys split's early first copies against none, bit for bit), attn_prefill for a chunk at the
end of 128K — at the 27B's attention shape; and greedy decoding with K = 3 drafts equal to plain greedy token for token after real random-token prompts of 40,000 and
100,000 tokens (the tiny spec made to hold 131,072 positions; the one-graph fused rounds) — where the random MTP head's
drafts are all rejected — and after 100,000 tokens of real text ending in a passage said twice, on the shipped small
model (trained: some of its drafts are accepted, so accepted drafts commit at long context too).
Run: pytest -m gpu tests/gpu/test_long_context_gpu.py -q -s"""
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml

from compiler.kernels import attn_combine, attn_decode, attn_prefill, qk_rope_kv
from compiler.spec import spec_from_dict
from harness import TARGET
from lab.cases import make_case

pytestmark = pytest.mark.gpu
CONTEXT, MAX_PAGES = 131072, 2048
HQ, HKV, D = 24, 4, 256                        # the 27B's attention layers


@pytest.fixture(scope="module")
def h():
    import harness
    return harness


def _check(h, key, ctx):
    h.build([key] + ([attn_combine.for_decode(key)] if key.family == "attn_decode" and key.splits > 1 else []))
    case = make_case(key, "cuda", (ctx or 0) % 97, ctx=ctx)
    h.run(case)
    h.compare(case, f"{key.name} at {ctx or 'random'} tokens")
    del case
    torch.cuda.empty_cache()


@pytest.mark.parametrize("ctx", [32769, 100_003, CONTEXT])
@pytest.mark.parametrize("t", [1, 4])
def test_rope_kv_append_past_32k(h, t, ctx):
    _check(h, qk_rope_kv.Key(HQ, HKV, D, 64, 1, t, "int8", 64, MAX_PAGES, 1e-6, TARGET.arch), ctx)


@pytest.mark.parametrize("ctx", [32769, 100_003, CONTEXT])
@pytest.mark.parametrize("t", [1, 4])
def test_attn_decode_past_32k(h, t, ctx):
    _check(h, attn_decode.make_key(HQ, HKV, D, 1, t, "int8", MAX_PAGES, TARGET), ctx)


@pytest.mark.parametrize("ctx", [1000, 40_010, 131_000])
@pytest.mark.parametrize("layout", ["shipped", "keys", "ring"])
def test_attn_decode_row_has_the_same_bits_in_a_decode_and_in_a_verify(h, layout, ctx):
    """Query row tt of a verify (T = 4, ctx keys, later keys masked) and the same query alone as a decode step
    (T = 1, ctx − 3 + tt keys) give the same bits: the kernel's chunks are the online softmax's steps whatever T
    is, so a lane's greedy tokens do not depend on its K or on its cohort (ctx % 64 ≥ 4: the same pages, hence
    the same splits) — with the shipped keys, the keys split over chunk lanes (attn_decode.keys_split: one row tile
    of 4 warps for the decode, three tiles of 12 warps for the verify) and the dims split's ring."""
    from dataclasses import replace

    k4 = attn_decode.make_key(HQ, HKV, D, 1, 4, "int8", MAX_PAGES, TARGET)
    k1 = replace(k4, t=1)
    if layout == "keys":                              # without its early first copies (shipped with them on sm_90)
        k4, k1 = (replace(attn_decode.keys_split(k), early=False) for k in (k4, k1))
    elif layout == "ring":
        k4, k1 = (replace(k, kw=0, stages=attn_decode.ring_stages(replace(k, kw=0, stages=0)))
                  for k in (replace(k, kw=0, stages=0, early=False) for k in (k4, k1)))
    h.build([k1, k4, attn_combine.for_decode(k1), attn_combine.for_decode(k4)])
    case = make_case(k4, "cuda", 7, ctx=ctx)
    h.run(case)
    _, (out4, _, _, q, gate, *pages, table, _) = case.launches[0]
    for tt in range(4):
        lens = torch.tensor([ctx - 3 + tt], dtype=torch.int32, device="cuda")
        q1 = q[:, tt:tt + 1].contiguous()
        gate1 = gate.view(1, 4, HQ, 2 * D)[:, tt].contiguous()
        out1 = torch.full((1, 1, HQ, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        part_o = torch.empty(1, HQ, k1.splits, D, device="cuda")
        part_ml = torch.empty(1, HQ, k1.splits, 2, device="cuda")
        h.launch_key(k1, attn_decode, [out1, part_o, part_ml, q1, gate1, *pages, table, lens])
        h.launch_key(attn_combine.for_decode(k1), attn_combine, [out1, part_o, part_ml, gate1, lens])
        torch.cuda.synchronize()
        assert torch.equal(out1[0, 0], out4[0, tt]), \
            f"row {tt}: differs in {(out1[0, 0] != out4[0, tt]).sum().item()} of {HQ * D} values"
    del case
    torch.cuda.empty_cache()


@pytest.mark.parametrize("t", [1, 4])
def test_attn_decode_ring_has_the_direct_loads_bits(h, t):
    """The shared-memory ring (templates/attn_decode_ring.cu.j2, 2 and 4 stages) writes the direct-load kernel's
    partials and, through the combine, output bit for bit at one row tile (T = 1) and two (T = 4): three rows of
    random lengths, the last padded (one page per split: 2 chunks, fewer than the ring's stages), and one row of
    40,010 keys (10 pages per split, a ragged last chunk)."""
    from dataclasses import replace

    from lab.attn_long import same_bits

    for b, ctx in ((3, None), (1, 40_010)):
        direct = replace(attn_decode.make_key(HQ, HKV, D, b, t, "int8", MAX_PAGES, TARGET), kw=0, stages=0,
                         early=False)
        for stages in (2, 4):
            ring = replace(direct, stages=stages)
            h.build([direct, ring, attn_combine.for_decode(direct)])
            case = make_case(ring, "cuda", 11 + b, ctx=ctx)
            same = same_bits(ring, direct, case, lambda k, a: h.KERNELS.bind(k, a))
            assert same, f"{ring.name}, b = {b}, ctx = {ctx}"
            del case
        torch.cuda.empty_cache()


@pytest.mark.parametrize("ctx", [None, 1000, 40_010, CONTEXT])
@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_attn_decode_keys_split_matches_the_reference(h, t, ctx):
    """The keys split over chunk lanes (templates/attn_decode_keys.cu.j2) against the fp32 reference: 1, 2, 4
    (one to three row tiles a block) and 8 query rows a kv head row (two row blocks), at one row of ctx keys
    and (None) three rows of random lengths, the last padded; and at the tiny spec's shape (d = 64, 2 query
    rows a kv head)."""
    _check(h, attn_decode.keys_split(attn_decode.make_key(HQ, HKV, D, 3 if ctx is None else 1, t, "int8",
                                                           MAX_PAGES, TARGET)), ctx)
    if ctx in (None, 1000):
        _check(h, attn_decode.keys_split(attn_decode.make_key(4, 2, 64, 3, t, "int8", 64, TARGET)), ctx)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_attn_decode_early_copies_keep_the_keys_splits_bits(h, t):
    """The keys split with its ring's first stages copied before the PDL wait (`early`, shipped on sm_90) writes the
    split's partials and output without them bit for bit: three rows of random lengths (the last padded), one row of
    40,010 keys (a ragged last chunk), and the tiny spec's d = 64."""
    from dataclasses import replace

    from lab.attn_long import same_bits

    for hq, hkv, d, b, ctx in ((HQ, HKV, D, 3, None), (HQ, HKV, D, 1, 40_010), (4, 2, 64, 3, None)):
        plain = replace(attn_decode.keys_split(attn_decode.make_key(hq, hkv, d, b, t, "int8", MAX_PAGES, TARGET)),
                        early=False)
        early = replace(plain, early=True)
        h.build([plain, early, attn_combine.for_decode(plain)])
        case = make_case(early, "cuda", 13 + b, ctx=ctx)
        assert same_bits(early, plain, case, lambda k, a: h.KERNELS.bind(k, a)), f"{early.name}, b = {b}, ctx = {ctx}"
        del case
        torch.cuda.empty_cache()


@pytest.mark.parametrize("groups", [1, 2, 3, 4])
def test_attn_combine_split_groups_match_the_reference(h, groups):
    """attn_combine with its splits reduced in 1 … 4 groups side by side (attn_combine.split_groups picks 4 at the
    27B's 66 splits) matches the fp32 reference for a verify's rows at 40,010 keys (3 groups: a last group
    shorter than the others)."""
    from dataclasses import replace

    key = attn_decode.make_key(HQ, HKV, D, 1, 4, "int8", MAX_PAGES, TARGET)
    case = make_case(key, "cuda", 5, ctx=40_010)
    case.launches = [(replace(k, groups=groups) if k.family == "attn_combine" else k, a) for k, a in case.launches]
    assert [k.groups for k, _ in case.launches if k.family == "attn_combine"] == [groups]
    h.build([k for k, _ in case.launches])
    h.run(case)
    h.compare(case, f"{key.name}, combine in {groups} groups")
    del case
    torch.cuda.empty_cache()


@pytest.mark.parametrize("ctx", [32800, CONTEXT])
def test_attn_prefill_chunk_at_the_end_of_128k(h, ctx):
    _check(h, attn_prefill.make_key(HQ, HKV, D, 64, "int8", MAX_PAGES, TARGET), ctx)


@pytest.fixture(scope="module")
def long_tiny():
    """The tiny spec holding 131,072 positions, on the GPU backend built for K = 3 (random weights, seed 0)."""
    import ninfer_gen
    from ninfer_gen.api import TINY_SPEC
    from ninfer_gen.cli.env import build_root

    data = yaml.safe_load(TINY_SPEC.read_text())
    data["name"] = "qwen3.8-tiny-128k"
    data["model"]["max_position_embeddings"] = 262144
    data["runtime"]["max_context"] = CONTEXT
    return ninfer_gen.load(spec_from_dict(data), backend="gpu", max_context=CONTEXT, draft=3, build_root=build_root())


@pytest.mark.parametrize("n", [40_000, 100_000])
def test_greedy_with_drafts_equals_plain_greedy_after_a_long_prompt(long_tiny, n):
    from ninfer_gen.sampling import SamplingParams
    from ninfer_gen.speculative import Stats

    vocab = long_tiny.spec.model.vocab_size
    prompt = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    plain = long_tiny.generate(prompt, 64)
    stats = Stats()
    spec = list(long_tiny.stream(prompt, 64, SamplingParams(), None, draft=3, stats=stats))
    assert len(plain) == len(spec) == 64
    assert stats.rounds > 0 and stats.drafted > 0
    if spec != plain:
        at = next(j for j, (a, b) in enumerate(zip(plain, spec)) if a != b)
        pytest.fail(f"after {n} prompt tokens, greedy with drafts parts from plain greedy at token {at}")
    print(f"{n} tokens: acceptance {stats.acceptance:.3f} over {stats.rounds} rounds")


SMALL = Path(__file__).resolve().parents[2] / "models/qwen3.8-small-py"


@pytest.fixture(scope="module")
def long_small():
    """The shipped small model (trained, with its MTP layer) made to hold 131,072 positions, on the GPU backend built
    for K = 3."""
    from dataclasses import replace

    import ninfer_gen
    from ninfer_gen.cli.env import build_root
    from ninfer_gen.executor.device_weights import from_host
    from ninfer_gen.executor.gpu_backend import GpuBackend
    from ninfer_gen.weights.checkpoint import load_checkpoint, quantize_weights

    spec, tensors = load_checkpoint(SMALL, require_mtp=True)
    spec = replace(spec, model=replace(spec.model, max_position_embeddings=262144),
                   runtime=replace(spec.runtime, draft_tokens=3, max_context=CONTEXT))
    backend = GpuBackend(spec, from_host(spec, quantize_weights(spec, tensors)), max_context=CONTEXT,
                         build_root=build_root())
    return ninfer_gen.Model(spec, backend, SMALL, "gpu")


def test_greedy_with_accepted_drafts_equals_plain_greedy_after_100k_tokens(long_small):
    """Python from the standard library up to 100,000 tokens, its last 4,096 a 2,048-token passage said twice: the
    trained MTP head's drafts are accepted (on the reference backend at 6,000 tokens: 15 of 54, 18 rounds), so the
    rounds commit accepted drafts at positions past 100,000 — the output still plain greedy's, token for token."""
    from ninfer_gen.sampling import SamplingParams
    from ninfer_gen.speculative import Stats

    n, passage = 100_000, 2048
    ids = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        ids += long_small.tokenizer.encode(f.read_text(errors="replace"))
        if len(ids) >= n:
            break
    prompt = ids[:n - 2 * passage] + 2 * ids[n - 2 * passage:n - passage]
    assert len(prompt) == n
    plain = long_small.generate(prompt, 64)
    stats = Stats()
    spec = list(long_small.stream(prompt, 64, SamplingParams(), None, draft=3, stats=stats))
    assert len(plain) == len(spec) == 64
    if spec != plain:
        at = next(j for j, (a, b) in enumerate(zip(plain, spec)) if a != b)
        pytest.fail(f"after {n} prompt tokens, greedy with drafts parts from plain greedy at token {at}")
    print(f"{n} tokens, small model: acceptance {stats.acceptance:.3f} over {stats.rounds} rounds, "
          f"{stats.accepted} drafts accepted")
    assert stats.accepted > 0, "no draft accepted: the commit of accepted drafts went untested"
