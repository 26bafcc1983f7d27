"""CPU tier for the GPU runtime's host side, with the kernel launcher replaced by a recorder (the only
part that needs a driver): every parameter of every call gets an address from the plan's bindings, the
executable launches exactly the keys `ninfer-gen build` compiles for the same runtime profile (tiny and
27B), folded norms, the conv fold and the Hopper xperm bind what their producers wrote, device-drawn
random weights have the packed planes' sizes, and step inputs pad rows safely."""
import inspect
from pathlib import Path

import pytest
import torch

from compiler.buckets import plan_bucket, plan_profile, plan_rounds, profile_keys, profile_of
from compiler.kernels import module_of
from compiler.options import CompileOptions
from compiler.spec import load_spec
from compiler.targets import lookup
from ninfer_gen.executor import executable
from ninfer_gen.weights.checkpoint import quantize_weights
from ninfer_gen.executor.device_state import DeviceState, ExecutableError, StepInputs
from ninfer_gen.executor.device_weights import from_host, random_on_device
from ninfer_gen.executor.executable import Executable
from ninfer_gen.weights.random_weights import random_weights

SPECS = Path(__file__).resolve().parents[1] / "model_specs"
TINY = load_spec(SPECS / "qwen3.8-tiny.yaml")
BIG = load_spec(SPECS / "qwen3.8-27b.yaml")
PROFILE = profile_of(TINY, max_context=32 * 64)


class RecordingKernels:
    """Stands in for KernelCache: records (key, args) instead of loading a module."""

    def __init__(self):
        self.calls = []
        self.programmatic = []
        self.built = []

    def build(self, keys):
        self.built += list(keys)

    def spilled(self):
        return []

    def bind(self, key, args, programmatic=True):
        self.calls.append((key, args))
        self.programmatic.append(programmatic)
        return (key, args)


class AnyWeights:
    """Every weight plane a plan names, as one small tensor (the 27B key-set test needs no real weights);
    records the names asked for."""

    def __init__(self):
        self.asked = set()
        self._t = torch.zeros(1)

    def plane(self, name, plane):
        self.asked.add((name, plane))
        return self._t


@pytest.fixture(scope="module")
def weights():
    return from_host(TINY, quantize_weights(TINY, random_weights(TINY)), device="cpu")


def _exe(weights, target="rtx3090", profile=PROFILE, slots=2):
    """An executable on the CPU with recorded launches: the tiny spec with real weights, or (weights None)
    the 27B with `AnyWeights` and a 4-page KV pool."""
    spec = TINY if weights is not None else BIG
    rounds = (max(profile.cohorts), profile.tail_tokens) if profile.speculative else (0, 0)
    state = DeviceState(spec, 64 if weights is not None else 4, slots, profile.kv_dtype, "cpu", *rounds,
                        snapshots=profile.snapshots, record_sets=profile.record_sets)
    rec = RecordingKernels()
    return Executable(spec, lookup(target), weights or AnyWeights(), state, rec, profile, "cpu"), rec


def _named(launchers):
    return [(k, dict(zip((p.name for p in module_of(k).params(k)), a))) for k, a in launchers]


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


@pytest.mark.parametrize("shape", [("step", 1, 1), ("step", 2, 4), ("prefill", 1, 256), ("prefill", 1, 32)])
def test_every_kernel_parameter_is_bound(weights, shape):
    exe, rec = _exe(weights)
    bucket = exe.bucket(*shape)
    assert len(bucket.launchers) == len(bucket.plan.calls) > 0
    arena = range(exe.arena.data_ptr(), exe.arena.data_ptr() + exe.arena.numel())
    for key, named in _named(bucket.launchers):
        for must in ("y", "x", "out", "q", "o", "qkv", "w_lo", "ids", "table", "hist", "state", "k_pages"):
            if must in named and not (key.family == "attn_decode" and must == "out" and key.splits > 1):
                assert named[must] != 0, f"{key.name}: {must} unbound"
        if key.family in ("gemv", "gemm", "rmsnorm"):
            assert named["y"] in arena, f"{key.name}: output outside the arena"
    assert bucket.logits.dtype == torch.float32 and bucket.logits.shape[-1] == TINY.model.vocab_size
    # Only the first kernel waits for all earlier work (kernels release their successors before their own
    # wait, common/ptx.cuh): a run never starts on state the previous run is still writing. rtx3090 has no
    # programmatic launch at all; h200 launches every later call programmatically.
    assert rec.programmatic == [False] * len(rec.programmatic)
    exe, rec = _exe(weights, "h200")
    exe.bucket(*shape)
    assert rec.programmatic == [False] + [True] * (len(rec.programmatic) - 1)


@pytest.mark.parametrize("spec_name", ["tiny", "27b"])
def test_executable_launches_exactly_what_build_compiles(weights, spec_name):
    """One source of kernel keys: the keys `ninfer-gen build` compiles for a runtime profile (its plans)
    equal the keys the executable binds when it runs every bucket of that profile — nothing more (no
    catalog extras), nothing less (no compile at request time)."""
    spec, w = (TINY, weights) if spec_name == "tiny" else (BIG, None)
    profile = profile_of(spec, cohorts=(1, 2, 4, 8), draft=3, max_context=4096)
    built = profile_keys(plan_profile(spec, lookup("rtx3090"), profile), plan_rounds(spec, lookup("rtx3090"), profile))
    exe, rec = _exe(w, profile=profile, slots=1)
    exe.prepare()                 # builds the profile's kernels and sizes memory for every plan
    assert set(rec.built) == set(built)
    memory = [exe.arena.data_ptr(), *(p.data_ptr() for p in exe.pools.values())]
    for shape in exe.shapes:
        exe.bucket(*shape)
    bucket_calls = len(rec.calls)
    for b, acceptance in profile.rounds():      # the one-graph rounds: their calls between the buckets
        exe.round(b, acceptance)
    launched = list(dict.fromkeys(k for k, _ in rec.calls))
    assert set(launched) == set(built) and len(launched) == len(built)
    # binding a prepared profile's buckets never moves memory (no bucket is rebound, no graph recaptured)
    assert memory == [exe.arena.data_ptr(), *(p.data_ptr() for p in exe.pools.values())]
    assert bucket_calls == sum(len(exe.plan(s).calls) for s in exe.shapes)
    with pytest.raises(ExecutableError, match="not in the runtime profile"):
        exe.bucket("step", 3, 1)


def test_executable_knows_no_kernel_family():
    """The executable resolves bindings by kind; a family or primitive name never steers it."""
    src = inspect.getsource(executable)
    assert ".family" not in src and "prim" not in src and "module_of" not in src


def test_hopper_prefill_gemm_reads_what_its_xperm_wrote(weights):
    """On sm_90 each gemm_wg call of a prefill bucket follows an xperm of the same activations, and
    both get one workspace region: xperm writes `xp`, gemm_wg reads it as `x`."""
    exe, _ = _exe(weights, "h200")
    bucket = exe.bucket("prefill", 1, 256)
    named = _named(bucket.launchers)
    wg = [i for i, (k, _) in enumerate(named) if k.family == "gemm_wg"]
    assert wg, "no gemm_wg call in a 256-token prefill on sm_90"
    calls = bucket.plan.calls
    for i in wg:                     # the last xperm before it permuted this call's input
        j = max(j for j in range(i) if named[j][0].family == "xperm")
        (pk, pargs), (k, args) = named[j], named[i]
        assert (pk.m, pk.k) == (k.m, k.k) and calls[j].inputs[0] == calls[i].inputs[0], f"{k.name}: stale xperm"
        assert pargs["xp"] == args["x"] != 0 and pargs["x"] != args["x"], f"{k.name}: reads another region"
    ws = exe.pools["scratch"]
    assert all(named[i][1]["x"] in range(ws.data_ptr(), ws.data_ptr() + ws.numel()) for i in wg)


def test_projections_of_one_input_share_an_xperm():
    """27B prefill on sm_90: the GDN layer's qkv and z projections (and attention's q, k, v) read one
    normed input, so one xperm serves them; every gemm_wg still follows an xperm of its own input."""
    calls = plan_bucket(BIG, lookup("h200"), "prefill", 1, 1024).calls
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


def test_concurrent_groups_are_the_independent_input_projections(weights):
    plan = plan_bucket(TINY, lookup("rtx3090"), "step", 2, 4)
    groups = plan.groups
    assert sorted(i for g in groups for i in g) == list(range(len(plan.calls)))
    multi = [g for g in groups if len(g) > 1]
    assert len(multi) == len(TINY.model.layers.kinds)    # per layer: GDN qkv/z/a/b or attention q/k/v
    for g in multi:
        calls = [plan.calls[i] for i in g]
        assert all(c.key.family == "gemv" for c in calls)
        assert len({c.inputs[0] for c in calls}) == 1          # the same normed activations
        written = {o for c in calls for o in c.outputs}
        assert not written & {x for c in calls for x in c.inputs}
        assert [c.lane for c in calls] == list(range(len(g)))  # one workspace lane each
    serial = plan_bucket(TINY, lookup("rtx3090"), "step", 2, 4, profile_of(TINY, options=CompileOptions(concurrency=1)))
    assert serial.groups == [[i] for i in range(len(serial.calls))] and serial.lanes == 1


@pytest.mark.parametrize("shape", [("step", 1, 1), ("step", 2, 4)])
def test_folded_norm_gemvs_share_xn_and_the_tile_sums(weights, shape):
    """A decode bucket's split RMSNorms: each `norm_out` GEMV writes xn and ssq into the arena with its
    layer's norm weight, and every `scale_in` GEMV reads exactly a producer's xn as x and its ssq."""
    exe, _ = _exe(weights)
    named = _named(exe.bucket(*shape).launchers)
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
    exe, _ = _exe(weights)
    step = exe.bucket("step", 2, 1)
    hists = {t.data_ptr(): layer for layer, t in exe.state.conv.items()}
    convs = [(k, a) for k, a in _named(step.launchers) if k.family == "gemv" and k.conv]
    assert len(convs) == sum(kind == "linear_attention" for kind in TINY.model.layers.kinds)
    layers = [hists[a["hist"]] for _, a in convs]
    assert len(set(layers)) == len(layers)
    for (k, a), layer in zip(convs, layers):
        assert a["conv_w"] == weights.tensors[f"layers.{layer}.linear_attn.conv1d.weight"].data_ptr(), k.name
        assert a["slots"] == step.inputs.ptr("slots") != 0
    assert not any(k.family == "gdn_conv" for k, _ in step.launchers)
    assert any(k.family == "gdn_conv" for k, _ in exe.bucket("step", 2, 4).launchers)
