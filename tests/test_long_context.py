"""Positions past 32,768 on the CPU (issue 31), with the tiny spec made to hold 131,072 tokens: the reference
RoPE against the exact rotation and the kernels' oracle; paged KV written and read through scrambled block
tables of 2,048 pages (the interpreter's kv_append / paged_attention and the GPU oracles' qk_rope_kv /
attn_decode against dense attention); the GPU buckets' int32 step inputs (executor.device_state) with 128K
positions and 2,048-page tables; the decode split rule at every 128K length; and speculative rounds at
contexts of 40,000 and 100,000 tokens through the engine — greedy with drafts equals plain greedy, the KV
and MTP writes land exactly at the positions they belong to, and the history is never touched.

A real 100K-token prefill costs minutes on the reference (attention is quadratic), so the end-to-end
test starts its lanes from a synthetic history: seeded INT8 K/V in every attention layer's pages (the main
layers' and the MTP's) for positions 0 … n − 1, restored at `open` the way a prefix checkpoint is
(`lane.cached` = n). The engine then prefills a real tail at positions n … and decodes."""

import pytest
import torch
import yaml

from compiler import reference_ops as ref
from compiler.kernels import attn_decode, qk_rope_kv
from compiler.spec import spec_from_dict
from compiler.targets import lookup
from ninfer_gen.api import TINY_SPEC
from ninfer_gen.engine import Engine, Request
from ninfer_gen.lanes.reference import ReferenceLanes
from ninfer_gen.reference import ReferenceBackend
from ninfer_gen.weights.random_weights import random_weights

CONTEXT = 131072
PAGE = 64
UNWRITTEN = -1.0          # fp16 scale no quantisation writes (scales are max|x| / 127 ≥ 0)


def long_tiny():
    """The tiny spec holding 131,072 positions per sequence (its model allows 262,144, as the 27B's)."""
    data = yaml.safe_load(TINY_SPEC.read_text())
    data["name"] = "qwen3.8-tiny-128k"
    data["model"]["max_position_embeddings"] = 262144
    data["runtime"]["max_context"] = CONTEXT
    return spec_from_dict(data)


# ------------------------------------------------------------------------------------------------ RoPE
POSITIONS = [0, 1, 32767, 32768, 32769, 65536, 100000, 100003, 131071]


def _exact_rope(x: torch.Tensor, pos: torch.Tensor, rd: int, theta: float) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    ang = pos.double()[:, None] * inv
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., :rd // 2], x[..., rd // 2:rd]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, x[..., rd:]], dim=-1)


def test_rope_past_32k_is_the_exact_rotation_to_fp32_angle_precision():
    """The angle is fp32(pos) · fp32(inv_freq) as HF computes it: its error grows as pos · 2^-24, so the
    rotation at 131,071 is good to ~1e-3 of |x| — and a wrapped or clamped position would be off by O(|x|)."""
    spec = long_tiny()
    at = spec.model.attention
    rd, theta = at.rotary_dim, at.rope_theta
    pos = torch.tensor(POSITIONS, dtype=torch.int32)
    x = torch.randn(len(POSITIONS), at.num_heads, at.head_dim, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0))
    got = ref.rope(x.float(), pos, rotary_dim=rd, theta=theta).double()
    exact = _exact_rope(x, pos, rd, theta)
    bound = (x[..., :rd].abs().amax() * 2 * (pos.double() * 2 ** -23 + 1e-6)).view(-1, 1, 1)
    err = (got - exact)[..., :rd].abs()
    assert (err <= bound).all(), f"RoPE error {err.amax(dim=(1, 2)).tolist()} at {POSITIONS}"
    assert torch.equal(got[..., rd:], x.float().double()[..., rd:])     # the other dims pass through
    shifted = ref.rope(x.float(), pos + 1, rotary_dim=rd, theta=theta).double()
    assert ((shifted - exact)[..., :rd].abs().amax(dim=(1, 2)) > 0.1).all()    # one position off is visible
    # the GPU kernel's oracle (and table) compute the same fp32 rotation bit for bit
    oracle = qk_rope_kv.rope(x.float(), pos, qk_rope_kv.inv_freq(theta, rd), rd)
    assert torch.equal(oracle.double(), got)


# ------------------------------------------------------------------------------------------------ paged KV
def _scrambled_table(pages: int, seed: int) -> list[int]:
    return torch.randperm(pages, generator=torch.Generator().manual_seed(seed)).tolist()


def _dense_attention(q, k, v, start, scale):
    """q [T, hq, d] at positions start … start + T − 1 over keys 0 … start + T − 1 (k, v [L, hkv, d])."""
    T, hq, _ = q.shape
    grp = hq // k.shape[1]
    length = start + T
    k, v = k[:length].repeat_interleave(grp, 1), v[:length].repeat_interleave(grp, 1)
    s = torch.einsum("thd,lhd->htl", q.double(), k.double()) * scale
    qpos = start + torch.arange(T).view(-1, 1)
    s = s.masked_fill(torch.arange(length).view(1, -1) > qpos, float("-inf"))
    return torch.einsum("htl,lhd->thd", torch.softmax(s, -1), v.double())


def test_paged_kv_through_a_scrambled_2048_page_table_matches_dense_attention():
    """K/V of 131,072 positions appended in unaligned chunks (one across 32,768) through a shuffled block table
    of 2,048 pages, then attention of decode and verify rows past 32K and 100K, against dense attention over
    the same quantised keys; the GPU's oracle (attn_decode.reference, its page layout) reads the same pages."""
    hkv, hq, d = 2, 4, 64
    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, CONTEXT, hkv, d, generator=g)
    v = torch.randn(1, CONTEXT, hkv, d, generator=g)
    k[0, 100_001] *= 40                                           # a needle the decode rows past 100K must find
    table = torch.tensor([_scrambled_table(CONTEXT // PAGE, 2)], dtype=torch.int32)
    codes = torch.zeros(CONTEXT // PAGE, 2, hkv, PAGE, d, dtype=torch.int8)
    scales = torch.full((CONTEXT // PAGE, 2, hkv, PAGE, d // 64), UNWRITTEN, dtype=torch.float16)
    for lo, hi in [(0, 32700), (32700, 32800), (32800, 100_003), (100_003, CONTEXT)]:
        ref.kv_append(k[:, lo:hi], v[:, lo:hi], table, torch.tensor([lo], dtype=torch.int32), codes, scales,
                      page_size=PAGE)
    assert (scales >= 0).all(), "a position of the 128K table was not written"
    kq = ref.dequantize_kv(*ref.quantize_kv(k[0]))
    vq = ref.dequantize_kv(*ref.quantize_kv(v[0]))
    pages = {"k": codes[:, 0], "v": codes[:, 1], "k_scales": scales[:, 0], "v_scales": scales[:, 1]}
    for start, T in [(32767, 1), (32768, 1), (100_002, 1), (100_000, 4), (CONTEXT - 4, 4)]:
        q = torch.randn(1, T, hq, d, generator=g)
        got = ref.paged_attention(q, table, torch.tensor([start], dtype=torch.int32), codes, scales,
                                  page_size=PAGE, scale=d ** -0.5)
        want = _dense_attention(q[0], kq, vq, start, d ** -0.5)
        torch.testing.assert_close(got[0].double(), want, rtol=1e-4, atol=1e-5)
        key = attn_decode.Key(hq, hkv, d, 1, T, "int8", PAGE, CONTEXT // PAGE, 8, False, "sm_86")
        oracle = attn_decode.reference(key, q.bfloat16(), None, pages, table,
                                       torch.tensor([start + T], dtype=torch.int32))
        torch.testing.assert_close(oracle[0].double(), want, rtol=2e-2, atol=2e-2)


def test_the_kernels_rope_kv_oracle_writes_the_page_and_slot_of_each_position_past_32k():
    """qk_rope_kv's reference (what the GPU test compares the kernel with) at rows of positions 32,767 …
    131,071 of two sequences with their own scrambled 2,048-page tables: each row writes its own (page, slot)
    — block_table[row's sequence, pos // 64], pos % 64 — and nothing else."""
    b, t, hq, hkv, d = 2, 2, 4, 2, 64
    key = qk_rope_kv.Key(hq, hkv, d, 16, b, t, "int8", PAGE, CONTEXT // PAGE, 1e-6, "sm_86")
    n_pages = 2 * CONTEXT // PAGE
    perm = _scrambled_table(n_pages, 3)
    table = torch.tensor([perm[:CONTEXT // PAGE], perm[CONTEXT // PAGE:]], dtype=torch.int32)
    pos = torch.tensor([32767, 32768, 131070, 131071], dtype=torch.int32)          # rows (b, t) in order
    g = torch.Generator().manual_seed(4)
    q, kk, v = (torch.randn(b * t, h, w, generator=g).bfloat16() for h, w in ((hq, 2 * d), (hkv, d), (hkv, d)))
    norm = torch.zeros(d).bfloat16()
    pages = {n: torch.zeros(n_pages, hkv, PAGE, d, dtype=torch.int8) for n in ("k", "v")}
    pages |= {n + "_scales": torch.full((n_pages, hkv, PAGE, 1), UNWRITTEN, dtype=torch.float16) for n in ("k", "v")}
    _, out = qk_rope_kv.reference(key, q, kk, v, norm, norm, qk_rope_kv.inv_freq(1e7, 16), pos, table, pages)
    written = {(int(p), int(s)) for p, _, s, _ in (out["k_scales"] != UNWRITTEN).nonzero().tolist()}
    want = {(int(table[r // t, int(p) // PAGE]), int(p) % PAGE) for r, p in enumerate(pos)}
    assert written == want
    assert {(int(p), int(s)) for p, _, s, _ in (out["v_scales"] != UNWRITTEN).nonzero().tolist()} == want


def test_the_gpu_step_inputs_hold_128k_positions_and_2048_page_tables():
    """executor.device_state.StepInputs (the host side of every bucket's int32 inputs, on the CPU here): rows
    of a verify at 131,068 … 131,071 and at 100,000 … 100,003 with their own scrambled tables; the rest of a
    row's table is the trash page, and a table wider than the bucket's is refused."""
    from ninfer_gen.executor.device_state import ExecutableError, StepInputs

    inputs = StepInputs(batch=2, tokens=4, max_pages=CONTEXT // PAGE, trash_page=2 * CONTEXT // PAGE, device="cpu")
    perm = _scrambled_table(2 * CONTEXT // PAGE, 5)
    tables = [perm[:CONTEXT // PAGE], perm[CONTEXT // PAGE:CONTEXT // PAGE + 100_004 // PAGE + 1]]
    inputs.set([[1, 2, 3, 4], [5, 6, 7, 8]], [CONTEXT - 4, 100_000], tables, [0, 1])
    v = inputs.views
    assert v["row_pos"].tolist() == [*range(CONTEXT - 4, CONTEXT), *range(100_000, 100_004)]
    assert v["pos"].tolist() == [CONTEXT - 4, 100_000] and v["seq_lens"].tolist() == [CONTEXT, 100_004]
    rows = v["block_table"].view(2, -1)
    assert rows[0].tolist() == tables[0]
    assert rows[1, :len(tables[1])].tolist() == tables[1] and (rows[1, len(tables[1]):] == 2 * CONTEXT // PAGE).all()
    with pytest.raises(ExecutableError, match="block table of 2049 pages exceeds the bucket's 2048"):
        inputs.set([[1, 2, 3, 4]], [CONTEXT], [perm[:CONTEXT // PAGE + 1]], [0])


def _split_runs(pages: int, splits: int) -> list[range]:
    """templates/common/paged.cuh's rule as attn_decode and attn_combine apply it: pps = max(⌈pages /
    splits⌉, 1) pages per split, the active splits ⌈pages / pps⌉."""
    pps = max(-(-pages // splits), 1)
    return [range(s * pps, min(pages, (s + 1) * pps)) for s in range(-(-pages // pps))]


def test_the_decode_split_rule_covers_every_page_once_at_every_length_to_128k():
    for target in ("sm_86", "sm_90"):
        splits = attn_decode.choose_splits(4, CONTEXT // PAGE, lookup(target))      # the 27B's 4 KV heads
        assert 1 < splits <= CONTEXT // PAGE
        for pages in range(1, CONTEXT // PAGE + 1):
            runs = _split_runs(pages, splits)
            assert len(runs) <= splits and all(len(r) for r in runs)
            assert [p for r in runs for p in r] == list(range(pages)), (target, pages)


# ------------------------------------------------------------------------------------------------ end to end
def _kv_names(backend) -> list[str]:
    return [n for n in backend.state if n.startswith("kv.")]


class HistoryLanes(ReferenceLanes):
    """Reference lanes whose sequences start from a synthetic history of `n` tokens (seeded INT8 K/V in
    every attention layer, the MTP's included), restored at `open` like a prefix checkpoint; the pool's other
    positions are marked unwritten first. Records each released lane's pages and length, and the tokens each
    round emitted."""

    def __init__(self, backend, n: int, seed: int = 0):
        super().__init__(backend)
        self.n, self.seed, self.released, self.emitted = n, seed, [], []

    def round(self, lanes):
        out = super().round(lanes)
        self.emitted += [len(tokens) for tokens in out.values()]
        return out

    def open(self, lane):
        super().open(lane)
        for name in _kv_names(self.backend):
            self.backend.state[name].fill_(UNWRITTEN if name.endswith(".scales") else 0)
        fill_history(self.backend, lane.seq, self.n, self.seed)
        lane.prefilled = lane.cached = self.n

    def release(self, lane):
        if lane.seq is not None:
            self.released.append((list(lane.seq.table.pages), lane.seq.length))
        super().release(lane)


def history(backend, n: int, seed: int) -> dict[str, torch.Tensor]:
    """The synthetic K/V of positions 0 … n − 1 per state tensor, by logical page (the same for a seed)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in _kv_names(backend):
        shape = (-(-n // PAGE), *backend.state[name].shape[1:])
        if name.endswith(".codes"):
            out[name] = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        else:                 # scales like real K/V's: O(1) values over 127 code steps
            out[name] = (torch.rand(shape, generator=g) * 0.02 + 0.005).half()
            out[name][-1, :, :, n % PAGE or PAGE:] = UNWRITTEN      # the last page past n: not history
    return out


def fill_history(backend, seq, n: int, seed: int) -> None:
    backend.reserve(seq, n)
    pages = torch.tensor(seq.table.pages)
    for name, values in history(backend, n, seed).items():
        backend.state[name][pages] = values
    seq.table.length = n


def _by_position(t: torch.Tensor) -> torch.Tensor:
    """Pages [n, 2 (k|v), hkv, page, x] as rows of positions [n · page, 2 · hkv · x]."""
    return t.permute(0, 3, 1, 2, 4).reshape(t.shape[0] * PAGE, -1)


def _positions(backend, scales: str, pages: list[int], upto: int) -> torch.Tensor:
    """Per position 0 … upto − 1 of a sequence (through its pages): whether the layer's K and V were written
    there (every head's scale no longer the UNWRITTEN mark)."""
    return (_by_position(backend.state[scales][torch.tensor(pages)]) != UNWRITTEN).all(-1)[:upto]


@pytest.fixture(scope="module")
def long_backend():
    spec = long_tiny()
    return ReferenceBackend(spec, random_weights(spec), device="cpu", kv_dtype="int8", max_sequences=1,
                            max_context=CONTEXT)


def _run(lanes: HistoryLanes, prompt: list[int], tokens: int, draft: int):
    """(tokens, stats) of one greedy request through a one-lane engine over `lanes`."""
    engine = Engine(lanes, lanes=1, max_queue=0, prefill_budget=64)    # the 96-token tail: 2 chunks
    handle = engine.submit(Request(prompt, tokens, draft=draft))
    final = handle.result()
    assert final.finish == "length", final.error
    return handle.tokens, final.stats


@pytest.mark.parametrize("n", [40_000, pytest.param(100_000, marks=pytest.mark.slow)])
def test_speculative_rounds_past_32k_and_100k_are_lossless_and_write_where_they_should(long_backend, n):
    """Plain greedy, then greedy with K = 3 drafts, from the same n-token history (on other physical pages):
    the same tokens; the steps and verifies wrote the main layer's K/V at exactly the positions they ran at,
    the rounds' MTP passes the MTP's (both equal to a teacher-forced prefill + MTP pass over the same tokens
    — a position off by one would rotate every K); plain decode wrote no MTP slot; the history is intact."""
    be, k, tokens = long_backend, 3, 12
    tail = torch.randint(0, be.spec.model.vocab_size, (96,), generator=torch.Generator().manual_seed(n)).tolist()
    prompt = [0] * n + tail                 # the history's ids are never read: its K/V are given
    lanes = HistoryLanes(be, n)
    assert lanes.caps.max_context == CONTEXT and be.pools.pages_per_seq == CONTEXT // PAGE
    main = next(name[:-len(".scales")] for name in _kv_names(be) if name.endswith(".scales") and "mtp" not in name)

    plain, _ = _run(lanes, prompt, tokens, 0)
    (pages0, length0), = lanes.released
    assert len(pages0) > 512 and length0 == len(prompt) + tokens - 1    # the last token is the next anchor
    written = _positions(be, main + ".scales", pages0, length0 + PAGE)
    assert written[:length0].all() and not written[length0:].any()    # the steps wrote exactly n … L − 1
    assert not _positions(be, "kv.mtp.scales", pages0, length0)[n:].any()     # plain decode runs no MTP

    lanes.emitted.clear()
    spec, stats = _run(lanes, prompt, tokens, k)
    pages1, length1 = lanes.released[1]
    assert pages1 != pages0 and length1 == length0       # other physical pages (handed back in reverse order)
    assert stats.rounds > 0 and stats.drafted == k * stats.rounds
    last = length1 - lanes.emitted[-1]                   # the last round verified last … last + K
    written = _positions(be, main + ".scales", pages1, length1 + 2 * PAGE)
    assert written[:length1].all() and not written[last + k + 1:].any(), "main K/V written out of place"
    mtp = _positions(be, "kv.mtp.scales", pages1, length1 + 2 * PAGE)    # its drafts' MTP pass: slots up to
    assert mtp[:last].all() and not mtp[last + k - 1:].any(), "MTP K/V written out of place"   # last + K − 2
    for name, values in history(be, n, lanes.seed).items():           # nothing wrote into the history
        got = _by_position(be.state[name][torch.tensor(pages1[:len(values)])])[:n]
        assert torch.equal(got, _by_position(values)[:n]), f"{name}: a history position was overwritten"
    ran = {layer: _kv_by_position(be, layer, pages1, n, length1) for layer in (main, "kv.mtp")}

    logits, pages = _teacher_forced(be, n, lanes.seed, tail + spec)      # overwrites the pool's pages
    for layer, (kv, step) in ran.items():              # the MTP's slots from `last` on hold drafts' provisional
        want, _ = _kv_by_position(be, layer, pages, n, length1)        # K/V: a round that never ran replaces it
        upto = (length1 if layer == main else last) - n
        err = (kv[:upto] - want[:upto]).abs().amax(-1)
        assert (err <= 2.5 * step[:upto]).all(), f"{layer}: K/V differ from the teacher-forced pass at " \
            f"positions {(n + (err > 2.5 * step[:upto]).nonzero().flatten()).tolist()[:8]}"
    if spec != plain:           # a near-tie of the plain run (the verify's matmuls see K + 1 rows, the step's
        i = next(j for j, (a, b) in enumerate(zip(plain, spec)) if a != b)     # one: fp32 rounding differs)
        top = logits[len(tail) - 1 + i].double().topk(2).values
        assert (top[0] - top[1]) < 1e-3, f"tokens part at {i} away from a tie: {plain} vs {spec}"


def _kv_by_position(be, layer: str, pages: list[int], lo: int, hi: int):
    """A layer's dequantised K|V rows of positions lo … hi − 1 [hi − lo, 2 · hkv · d] and each row's
    largest quantisation step."""
    idx = torch.tensor(pages)
    codes, scales = (_by_position(be.state[f"{layer}.{part}"][idx])[lo:hi] for part in ("codes", "scales"))
    steps = scales.float()
    per_group = codes.shape[1] // steps.shape[1]
    kv = codes.float() * steps.repeat_interleave(per_group, dim=1)
    return kv, steps.amax(-1)


def _teacher_forced(be, n: int, seed: int, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Prefill of `ids` but the last at n over the same history, then the MTP over every slot with the next
    token (teacher-forced): (logits [len(ids) − 1, V], the sequence's pages, whose contents stay in the pool)."""
    seq = be.new_sequence()
    try:
        fill_history(be, seq, n, seed)
        logits, hidden = be.prefill(seq, ids[:-1], chunk=64)
        be.mtp(seq, hidden, ids[1:], n, chunk=64)
        return logits, list(seq.table.pages)
    finally:
        be.release(seq)
