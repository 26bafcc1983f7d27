"""The reference backend made fast without moving a bit (issue 21, item 5): its interpreter (`Program`) and
references (views and copies for state slots, page runs for KV, per-weight constants, kept RoPE angles)
against the straightforward forms they replaced — the plain interpreter walk and the references as of
commit 2532462, kept below as the oracle — on the shipped small model: prefill chunks (the chunked GDN
form), decode steps across a KV page boundary, a verify and commit (ReplaySSM records and folds), the
MTP head, a two-row step with a padding row and slots out of order; with fp32 KV, INT8 KV and bf16
activations. Logits, hidden states and every state tensor must agree to rounding (tests/rounding.py): the
two forms make the same torch calls on the same values, but their buffers sit at other addresses, and
torch's threaded CPU matmul does not keep its bits across addresses or thread splits (measured: equal at
one thread, up to 7.5e-7 of the largest magnitude at 2 threads). Where the bits are ours alone — the kept
weight constants, elementwise on small tensors — they are compared bit for bit.

Speed is not asserted here: `python -m lab.reference_speed` prints it.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ninfer_gen
from compiler import reference_ops as ref
from compiler.interpret import Program
from compiler.ir import Lit
from compiler.prims import PRIMS
from ninfer_gen.reference import ReferenceBackend
from rounding import assert_same_to_rounding

PROMPT = ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\n"
          "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
          "        self.items.append(item)\n")


# ------------------------------------------------ the oracle: the references as of 2532462, unchanged

def _valid(ids):
    return None if ids is None else (ids >= 0).nonzero().flatten()


def linear(x, w):
    return x @ w.to(x.dtype).t()


def rmsnorm(x, w, *, eps, offset):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (offset + w.float())).to(x.dtype)


def rope(x, pos, *, rotary_dim, theta):
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=x.device) / rotary_dim))
    freqs = pos.float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def gdn_conv_output(c, w, hist):
    B, T, C = c.shape
    K = w.shape[-1]
    full = torch.cat((hist, c.transpose(1, 2)), dim=-1)
    taps = w.to(c.dtype).reshape(C, K)
    acc = sum(taps[None, :, j, None] * full[:, :, j:j + T] for j in range(K))
    return F.silu(acc).transpose(1, 2).to(c.dtype), full


def gdn_conv(c, w, history, slots):
    B, T, C = c.shape
    K = w.shape[-1]
    hist = c.new_zeros(B, C, K - 1) if history is None else history[slots.long().clamp(min=0)].to(c.dtype)
    out, full = gdn_conv_output(c, w, hist)
    if history is not None:
        rows = _valid(slots)
        history[slots[rows].long()] = full[rows, :, -(K - 1):].to(history.dtype)
    return out


def gdn_gates(a, b, a_log, dt_bias):
    beta = torch.sigmoid(b.float())
    g = -torch.exp(a_log.float()) * F.softplus(a.float() + dt_bias.float())
    return g, beta


def _gdn_recurrent(q, k, v, g, beta, s):
    outs = []
    for t in range(q.shape[2]):
        s = s * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]
        delta = (v[:, :, t] - (s * kt[..., None]).sum(-2)) * beta[:, :, t, None]
        s = s + kt[..., None] * delta[..., None, :]
        outs.append((s * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outs, dim=2), s


def gdn_recurrence(q, k, v, g, beta, state, slots):
    B, T, hk, dk = q.shape
    hv = v.shape[2]
    grp = hv // hk
    qf = (ref.l2norm(q.float()) / dk ** 0.5).repeat_interleave(grp, dim=2).transpose(1, 2)
    kf = ref.l2norm(k.float()).repeat_interleave(grp, dim=2).transpose(1, 2)
    vf, gf, bf = v.float().transpose(1, 2), g.float().transpose(1, 2), beta.float().transpose(1, 2)
    if state is None:
        s0 = vf.new_zeros(B, hv, dk, v.shape[3])
    else:
        s0 = state[slots.long().clamp(min=0)]
    step = _gdn_recurrent if T <= 8 else ref._gdn_chunked
    out, s1 = step(qf, kf, vf, gf, bf, s0)
    if state is not None:
        rows = _valid(slots)
        state[slots[rows].long()] = s1[rows]
    return out.transpose(1, 2).to(v.dtype)


def _token_pages(block_table, pos, tokens, page_size):
    p = pos.long()[:, None] + torch.arange(tokens, device=pos.device)
    pages = block_table.long().gather(1, (p // page_size).clamp(min=0))
    return pages, p % page_size


def kv_append(k, v, block_table, pos, *cache, page_size):
    rows = _valid(pos)
    pages, offs = _token_pages(block_table[rows], pos[rows], k.shape[1], page_size)
    for which, x in enumerate((k[rows], v[rows])):
        if len(cache) == 2:
            codes, scale = ref.quantize_kv(x)
            cache[0][pages, which, :, offs] = codes
            cache[1][pages, which, :, offs] = scale
        else:
            cache[0][pages, which, :, offs] = x.to(cache[0].dtype)


def _read_kv(cache, pages, offs, which):
    if len(cache) == 2:
        return ref.dequantize_kv(cache[0][pages, which, :, offs], cache[1][pages, which, :, offs])
    return cache[0][pages, which, :, offs].float()


def paged_attention(q, block_table, pos, *cache, page_size, scale):
    B, T, hq, _ = q.shape
    out = torch.zeros_like(q)
    for b in _valid(pos).tolist():
        length = int(pos[b]) + T
        idx = torch.arange(length, device=q.device)
        pages = block_table[b].long()[idx // page_size]
        k, v = (_read_kv(cache, pages, idx % page_size, w).to(q.dtype) for w in (0, 1))
        grp = hq // k.shape[1]
        k, v = k.repeat_interleave(grp, dim=1), v.repeat_interleave(grp, dim=1)
        scores = torch.einsum("thd,lhd->htl", q[b].float(), k.float()) * scale
        qpos = int(pos[b]) + torch.arange(T, device=q.device)
        scores = scores.masked_fill(idx[None, None, :] > qpos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("htl,lhd->thd", probs, v.float()).to(q.dtype)
    return out


def gdn_conv_record(c, w, history, slots, rec):
    hist = history[slots.long().clamp(min=0)].to(c.dtype)
    out, _ = gdn_conv_output(c, w, hist)
    rows = _valid(slots)
    rec[rows] = c[rows].to(rec.dtype)
    return out


def gdn_conv_fold(history, slots, rec, commit):
    width = history.shape[-1]
    for r in _valid(slots).tolist():
        m = min(int(commit[r]), rec.shape[1])
        if m > 0:
            s = int(slots[r])
            full = torch.cat((history[s], rec[r, :m].transpose(0, 1).to(history.dtype)), dim=-1)
            history[s] = full[:, -width:]


def gdn_recurrence_record(q, k, v, g, beta, state, slots, rec_k, rec_v, rec_g):
    B, T, hk, dk = q.shape
    grp = v.shape[2] // hk
    qf = (ref.l2norm(q.float()) / dk ** 0.5).repeat_interleave(grp, dim=2).transpose(1, 2)
    kf = ref.l2norm(k.float()).repeat_interleave(grp, dim=2).transpose(1, 2)
    vf, gf, bf = v.float().transpose(1, 2), g.float().transpose(1, 2), beta.float().transpose(1, 2)
    out, _ = _gdn_recurrent(qf, kf, vf, gf, bf, state[slots.long().clamp(min=0)])
    rows = _valid(slots)
    rec_k[rows], rec_v[rows] = k[rows].to(rec_k.dtype), v[rows].to(rec_v.dtype)
    rec_g[rows] = torch.stack((g.float(), beta.float()), dim=-1)[rows]
    return out.transpose(1, 2).to(v.dtype)


def gdn_fold(state, slots, rec_k, rec_v, rec_g, commit):
    hk = rec_k.shape[2]
    grp = rec_v.shape[2] // hk
    for r in _valid(slots).tolist():
        m = min(int(commit[r]), rec_k.shape[1])
        if m <= 0:
            continue
        s = int(slots[r])
        kf = ref.l2norm(rec_k[r:r + 1, :m].float()).repeat_interleave(grp, dim=2).transpose(1, 2)
        vf = rec_v[r:r + 1, :m].float().transpose(1, 2)
        gb = rec_g[r:r + 1, :m].transpose(1, 2)
        _, s1 = _gdn_recurrent(torch.zeros_like(kf), kf, vf, gb[..., 0], gb[..., 1], state[s:s + 1])
        state[s] = s1[0]


ORACLE = {name: globals()[name] for name in (
    "linear", "rmsnorm", "rope", "gdn_conv", "gdn_gates", "gdn_recurrence", "kv_append", "paged_attention",
    "gdn_conv_record", "gdn_conv_fold", "gdn_recurrence_record", "gdn_fold")}


def plain_run_graph(graph, inputs, weights, state):
    """The interpreter as of 2532462: a walk over the equations with a dict of values."""
    env = {}
    for declared, values in ((graph.inputs, inputs), (graph.weights, weights), (graph.state, state)):
        for k, v in declared.items():
            env[v.uid] = values[k]
    for eqn in graph.eqns:
        args = [None if x is None else x.value if isinstance(x, Lit) else env[x.uid] for x in eqn.inputs]
        out = ORACLE.get(eqn.prim, PRIMS[eqn.prim].reference)(*args, **eqn.params)
        outs = [] if out is None else list(out) if isinstance(out, tuple) else [out]
        for var, val in zip(eqn.outputs, outs, strict=True):
            env[var.uid] = val
    return {k: env[v.uid] for k, v in graph.outputs.items()}


class PlainBackend(ReferenceBackend):
    """The reference backend with every graph run by the oracle above."""

    def _run(self, entry, batch, tokens, inputs, state):
        return plain_run_graph(self.graph(entry, batch, tokens), inputs, self.weights, state)


# ------------------------------------------------ the comparison

@pytest.fixture(scope="module")
def shipped():
    model = ninfer_gen.load(device="cpu")
    weights = {k: v.clone() for k, v in model.backend.weights.items()}
    return model, weights


def _same(a, b, what):
    """Bit for bit: for results our code decides alone (elementwise torch on small tensors, one thread)."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a, b), f"{what}: differs by {(a.double() - b.double()).abs().max().item():.3g}"


def _session(be, ids, prompt: int):
    """One sequence through every entry point, then a second sequence and a two-row step; yields (label,
    tensor) as it goes. With a prompt of 59 the prefill runs chunks of T = 32 (the chunked GDN form) and 27,
    and the verify and the last steps cross position 64 (a page boundary)."""
    seq = be.new_sequence()
    logits, hidden = be.prefill(seq, ids[:prompt], chunk=32)
    yield "prefill", logits
    token = int(logits[-1].argmax())
    for i in range(2):
        logits, hidden = be.run("step", [seq], [[token]])
        yield f"step {i}", logits
        token = int(logits[-1].argmax())
    draft, normed = be.run("mtp", [seq], [[token]], hidden[-1:], starts=[seq.length - 1])
    yield "mtp", draft
    yield "mtp hidden", normed
    logits, hidden = be.verify(seq, [token, 7, 8, 9])
    yield "verify", logits
    yield "verify hidden", hidden
    be.commit(seq, 2)
    for i in range(3):
        logits, hidden = be.run("step", [seq], [[ids[prompt + i]]])
        yield f"step after commit {i}", logits
    other = be.new_sequence()
    logits, _ = be.prefill(other, ids[:5])
    yield "second prefill", logits
    logits, hidden = be.run("step", [other, seq], [[ids[5]], [ids[63]]])  # slots out of order: gathered
    yield "two-row step", logits
    yield "two-row hidden", hidden
    be.release(other)
    be.release(seq)


def _padded_step(be, ids):
    """A two-row step and verify + commit straight through the interpreter with row 0 padding (slot and
    position −1): the padding row reads slot 0 and writes nothing."""
    be.program("step", 2, 1)
    seq = be.new_sequence()
    be.prefill(seq, ids[:6])
    table = be._block_table([seq, seq])
    inputs = {"tokens": be._i32([[3], [ids[6]]]), "pos": be._i32([-1, 6]), "block_table": table,
              "slots": be._i32([-1, seq.slot])}
    out = be._run("step", 2, 1, inputs, be.state)
    yield "padded step", out["logits"]
    records = be.records(2, 2)
    inputs = {"tokens": be._i32([[3, 4], [ids[7], ids[8]]]), "pos": be._i32([-1, 7]), "block_table": table,
              "slots": be._i32([-1, seq.slot])}
    out = be._run("verify", 2, 2, inputs, be.state | records)
    yield "padded verify", out["logits"]
    be._run("commit", 2, 2, {"slots": be._i32([-1, seq.slot]), "commit": be._i32([2, 1])}, be.state | records)
    be.release(seq)


@pytest.mark.parametrize("dtype,kv,prompt", [("float32", None, 59), ("float32", "int8", 59), ("bfloat16", None, 10)])
def test_fast_reference_equals_the_plain_one_to_rounding(shipped, dtype, kv, prompt):
    model, weights = shipped
    ids = model.tokenizer.encode(PROMPT)
    assert len(ids) >= 64
    fast = ReferenceBackend(model.spec, weights, dtype=dtype, kv_dtype=kv, max_context=256)
    plain = PlainBackend(model.spec, weights, dtype=dtype, kv_dtype=kv, max_context=256)
    for (label, a), (_, b) in zip(_session(fast, ids, prompt), _session(plain, ids, prompt), strict=True):
        assert_same_to_rounding(a, b, label)
    for (label, a), (_, b) in zip(_padded_step(fast, ids), _padded_step(plain, ids), strict=True):
        assert_same_to_rounding(a, b, label)
    for name in fast.state:
        assert_same_to_rounding(fast.state[name], plain.state[name], f"state {name}")


def test_program_runs_a_graph_as_the_plain_walk_does(shipped):
    """Program, not the backend: the same graph and bindings twice, and its error for a missing binding."""
    model, _ = shipped
    be = model.backend
    graph = be.graph("step", 1, 1)
    seq = be.new_sequence()
    be.prefill(seq, [1, 2, 3])
    inputs = {"tokens": be._i32([[4]]), "pos": be._i32([3]), "block_table": be._block_table([seq]),
              "slots": be._i32([seq.slot])}
    before = {k: v.clone() for k, v in be.state.items()}
    got = Program(graph).run(inputs, be.weights, be.state)
    after = {k: v.clone() for k, v in be.state.items()}
    be.state.update({k: v.clone() for k, v in before.items()})
    want = plain_run_graph(graph, inputs, be.weights, be.state)
    for k in got:                                   # the same torch calls from other buffers: to rounding
        assert_same_to_rounding(got[k], want[k], k)
    for k in after:
        assert_same_to_rounding(after[k], be.state[k], k)
    be.release(seq)
    with pytest.raises(KeyError, match="no input bound for slots"):
        Program(graph).run({k: v for k, v in inputs.items() if k != "slots"}, be.weights, be.state)


def test_kept_weight_constants_follow_the_weight():
    """The per-weight constants (RMSNorm scale, conv taps, −exp(A_log)) are recomputed when the weight is
    written in place, and a weight that takes part in autograd gets its gradient."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 16), torch.randn(16)
    _same(ref.rmsnorm(x, w, eps=1e-6, offset=1.0), rmsnorm(x, w, eps=1e-6, offset=1.0), "norm")
    w.mul_(3)
    _same(ref.rmsnorm(x, w, eps=1e-6, offset=1.0), rmsnorm(x, w, eps=1e-6, offset=1.0), "norm after a write")
    a_log, a, b, dt = torch.randn(4), torch.randn(2, 4), torch.randn(2, 4), torch.randn(4)
    ref.gdn_gates(a, b, a_log, dt)
    a_log.add_(1)
    for got, want in zip(ref.gdn_gates(a, b, a_log, dt), gdn_gates(a, b, a_log, dt)):
        _same(got, want, "gates after a write")
    c, cw, hist = torch.randn(1, 3, 8), torch.randn(8, 1, 4), torch.zeros(2, 8, 3)
    ref.gdn_conv(c, cw, hist.clone(), torch.tensor([1]))
    cw.neg_()
    _same(ref.gdn_conv(c, cw, hist.clone(), torch.tensor([1])), gdn_conv(c, cw, hist.clone(), torch.tensor([1])),
          "conv after a write")
    wg = torch.randn(16, requires_grad=True)
    ref.rmsnorm(x, wg, eps=1e-6, offset=1.0).square().sum().backward()
    want = torch.autograd.grad(rmsnorm(x, wg, eps=1e-6, offset=1.0).square().sum(), wg)[0]
    _same(wg.grad, want, "gradient")
