"""CPU tier for the GPU runtime's host side: every parameter of every kernel in the tiny spec's
buckets gets an argument from the executable (with the kernel launcher replaced by a recorder, the
only part that needs a driver), device-drawn random weights have the packed planes' exact sizes,
step inputs fill padded rows safely, and prompts are cut into the right buckets."""
from pathlib import Path

import pytest
import torch

from compiler.buckets import plan_bucket
from compiler.kernels import module_of
from compiler.spec import load_spec
from compiler.targets import lookup
from ninfer_gen.checkpoint import quantize_weights
from ninfer_gen.device_weights import from_host, random_on_device
from ninfer_gen.device_state import DeviceState, StepInputs
from ninfer_gen.executable import Executable
from ninfer_gen.gpu_backend import prompt_pieces
from ninfer_gen.random_weights import random_weights

TINY = load_spec(Path(__file__).resolve().parents[1] / "model_specs/qwen3.8-tiny.yaml")


class RecordingKernels:
    """Stands in for KernelCache.bind: records (key, args) instead of loading a module."""

    def __init__(self):
        self.calls = []
        self.programmatic = []

    def build(self, keys):
        pass

    def spilled(self):
        return []

    def bind(self, key, args, programmatic=True):
        self.calls.append((key, args))
        self.programmatic.append(programmatic)
        return (key, args)


@pytest.fixture(scope="module")
def weights():
    return from_host(TINY, quantize_weights(TINY, random_weights(TINY)), device="cpu")


def test_random_device_weights_have_the_packed_sizes(weights):
    drawn = random_on_device(TINY, seed=3, device="cpu")
    assert drawn.matrices.keys() == weights.matrices.keys()
    for name, planes in weights.matrices.items():
        assert drawn.formats[name] == weights.formats[name]
        for plane, t in planes.items():
            got = drawn.matrices[name][plane]
            assert got.numel() * got.element_size() == t.numel() * t.element_size(), (name, plane)
    assert drawn.tensors.keys() == weights.tensors.keys()
    assert drawn.embed_codes.shape == weights.embed_codes.shape


@pytest.mark.parametrize("shape", [("step", 1, 1), ("step", 2, 4), ("prefill", 1, 256), ("prefill", 1, 48)])
def test_every_kernel_parameter_is_bound(weights, shape):
    rec = RecordingKernels()
    state = DeviceState(TINY, 64, 2, "int8", "cpu")
    exe = Executable(TINY, lookup("rtx3090"), weights, state, rec, 32, "cpu")
    bucket = exe.bucket(*shape)
    assert len(bucket.launchers) == len(bucket.plan.calls) > 0
    arena = range(exe.arena.data_ptr(), exe.arena.data_ptr() + exe.arena.numel())
    for key, args in bucket.launchers:
        params = module_of(key).params(key)
        assert len(args) == len(params)
        named = dict(zip((p.name for p in params), args))
        for must in ("y", "x", "out", "q", "o", "qkv", "w_lo", "ids", "table", "hist", "state", "k_pages"):
            if must in named and not (key.family == "attn_decode" and must == "out" and key.splits > 1):
                assert named[must] != 0, f"{key.name}: {must} unbound"
        if key.family in ("gemv", "gemm", "rmsnorm"):
            assert named["y"] in arena, f"{key.name}: output outside the arena"
    assert bucket.logits.dtype == torch.float32 and bucket.logits.shape[-1] == TINY.model.vocab_size
    # Only the first kernel waits for all earlier work (kernels release their successors before their own
    # wait, common/ptx.cuh): a run never starts on state the previous run is still writing.
    assert rec.programmatic == [False] + [True] * (len(rec.programmatic) - 1)


def test_hopper_prefill_gemm_reads_what_its_xperm_wrote(weights):
    """On sm_90 each gemm_wg call of a prefill bucket follows an xperm of the same activations, and
    both get one workspace region: xperm writes `xp`, gemm_wg reads it as `x`."""
    rec = RecordingKernels()
    state = DeviceState(TINY, 64, 2, "int8", "cpu")
    exe = Executable(TINY, lookup("h200"), weights, state, rec, 32, "cpu")
    bucket = exe.bucket("prefill", 1, 256)
    named = [(k, dict(zip((p.name for p in module_of(k).params(k)), a))) for k, a in bucket.launchers]
    wg = [i for i, (k, _) in enumerate(named) if k.family == "gemm_wg"]
    assert wg, "no gemm_wg call in a 256-token prefill on sm_90"
    calls = bucket.plan.calls
    for i in wg:                     # the last xperm before it permuted this call's input
        j = max(j for j in range(i) if named[j][0].family == "xperm")
        (pk, pargs), (k, args) = named[j], named[i]
        assert (pk.m, pk.k) == (k.m, k.k) and calls[j].inputs[0] == calls[i].inputs[0], f"{k.name}: stale xperm"
        assert pargs["xp"] == args["x"] != 0 and pargs["x"] != args["x"], f"{k.name}: reads another region"
    ws = range(exe.workspace.data_ptr(), exe.workspace.data_ptr() + exe.workspace.numel())
    assert all(named[i][1]["x"] in ws for i in wg)


def test_projections_of_one_input_share_an_xperm():
    """27B prefill on sm_90: the GDN layer's qkv and z projections (and attention's q, k, v) read one
    normed input, so one xperm serves them; every gemm_wg still follows an xperm of its own input."""
    big = load_spec(Path(__file__).resolve().parents[1] / "model_specs/qwen3.8-27b.yaml")
    calls = plan_bucket(big, lookup("h200"), "prefill", 1, 1024).calls
    perms = [i for i, c in enumerate(calls) if c.key.family == "xperm"]
    wg = [i for i, c in enumerate(calls) if c.key.family == "gemm_wg"]
    assert 0 < len(perms) < len(wg)
    for i in wg:
        j = max(j for j in perms if j < i)
        assert calls[j].inputs[0] == calls[i].inputs[0] and calls[j].key.k == calls[i].key.k


def test_step_inputs_pad_rows_to_the_trash_page():
    inputs = StepInputs(batch=2, tokens=4, max_pages=3, trash_page=9, device="cpu")
    inputs.set([[5, 6, 7, 8]], [10], [[4, 2]], [1])
    v = inputs.views
    assert v["tokens"].tolist() == [5, 6, 7, 8, 0, 0, 0, 0]
    assert v["row_pos"].tolist()[:4] == [10, 11, 12, 13]
    assert v["block_table"].tolist() == [4, 2, 9, 9, 9, 9]
    assert v["slots"].tolist() == [1, -1] and v["seq_lens"].tolist() == [14, 0]
    with pytest.raises(RuntimeError, match="bucket"):
        inputs.set([[1, 2]], [0], [[0]], [0])


@pytest.mark.parametrize("n,chunk,expected", [
    (30, 1024, [("prefill", 16), ("step", 4), ("step", 4), ("step", 4), ("step", 1), ("step", 1)]),
    (2048 + 40, 1024, [("prefill", 1024), ("prefill", 1024), ("prefill", 32), ("step", 4), ("step", 4)]),
    (3, 64, [("step", 1)] * 3),
])
def test_prompt_pieces(n, chunk, expected):
    pieces = prompt_pieces(n, chunk)
    assert pieces == expected and sum(t for _, t in pieces) == n


def test_concurrent_groups_are_the_independent_input_projections():
    from compiler.buckets import plan_bucket
    from ninfer_gen.executable import concurrent_groups

    plan = plan_bucket(TINY, lookup("rtx3090"), "step", 2, 4)
    groups = concurrent_groups(plan)
    assert sorted(i for g in groups for i in g) == list(range(len(plan.calls)))
    multi = [g for g in groups if len(g) > 1]
    kinds = TINY.model.layers.kinds
    assert len(multi) == len(kinds)            # per layer: GDN qkv/z/a/b or attention q/k/v
    for g in multi:
        calls = [plan.calls[i] for i in g]
        assert all(c.key.family == "gemv" for c in calls)
        assert len({c.inputs[0] for c in calls}) == 1          # the same normed activations
        written = {o for c in calls for o in c.outputs}
        assert not written & {x for c in calls for x in c.inputs}
    assert concurrent_groups(plan, has_workspace=lambda key: True) == [[i] for i in range(len(plan.calls))]


@pytest.mark.parametrize("shape", [("step", 1, 1), ("step", 2, 4)])
def test_folded_norm_gemvs_share_xn_and_the_tile_sums(weights, shape):
    """A decode bucket's split RMSNorms: each `norm_out` GEMV writes xn and ssq into the arena with its
    layer's norm weight, and every `scale_in` GEMV reads exactly a producer's xn as x and its ssq."""
    rec = RecordingKernels()
    exe = Executable(TINY, lookup("rtx3090"), weights, DeviceState(TINY, 64, 2, "int8", "cpu"), rec, 32, "cpu")
    bucket = exe.bucket(*shape)
    named = [(k, dict(zip((p.name for p in module_of(k).params(k)), a))) for k, a in bucket.launchers]
    arena = range(exe.arena.data_ptr(), exe.arena.data_ptr() + exe.arena.numel())
    norm_ws = {t.data_ptr() for name, t in weights.tensors.items() if "layernorm" in name}
    made = {}
    for k, a in named:
        if k.family == "gemv" and k.scale_in:
            assert made.get(a["x"]) == a["ssq_in"], f"{k.name}: reads no producer's xn / ssq pair"
        if k.family == "gemv" and k.norm_out:
            assert a["xn"] in arena and a["ssq_out"] in arena and a["norm_w"] in norm_ws, k.name
            assert a["y"] != a["xn"] and a["res"] != 0, k.name
            made[a["xn"]] = a["ssq_out"]
    folded = 2 * TINY.model.layers.count - 1
    assert sum(k.family == "gemv" and k.norm_out for k, _ in named) == folded
    assert [k.family for k, _ in named].count("rmsnorm") == 2


def test_conv_in_the_qkv_gemv_binds_the_layer_history(weights):
    """A one-token step's qkv GEMVs carry the GDN conv: taps = the layer's conv1d weight, history = the
    layer's conv state, slots = the step's slot input; a verify step keeps the conv kernel."""
    rec = RecordingKernels()
    state = DeviceState(TINY, 64, 2, "int8", "cpu")
    exe = Executable(TINY, lookup("rtx3090"), weights, state, rec, 32, "cpu")
    step = exe.bucket("step", 2, 1)
    hists = {t.data_ptr(): layer for layer, t in state.conv.items()}
    convs = [(k, dict(zip((p.name for p in module_of(k).params(k)), a))) for k, a in step.launchers
             if k.family == "gemv" and k.conv]
    assert len(convs) == sum(kind == "linear_attention" for kind in TINY.model.layers.kinds)
    layers = [hists[a["hist"]] for _, a in convs]
    assert len(set(layers)) == len(layers)
    for (k, a), layer in zip(convs, layers):
        assert a["conv_w"] == weights.tensors[f"layers.{layer}.linear_attn.conv1d.weight"].data_ptr(), k.name
        assert a["slots"] == step.inputs.ptr("slots") != 0
    assert not any(k.family == "gdn_conv" for k, _ in step.launchers)
    assert any(k.family == "gdn_conv" for k, _ in exe.bucket("step", 2, 4).launchers)
