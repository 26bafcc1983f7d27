"""CPU tier for the reduced draft vocabulary and the one-graph round's plan: the ranking and its file, the
draft head gathered from the LM head's packed planes bit for bit, the MTP plan and round over the
draft rows, and the round's bindings (every kernel parameter bound, the round state shared)."""
import json
from pathlib import Path

import pytest
import torch

from compiler.options import CompileOptions
from compiler.buckets import plan_bucket, plan_rounds, profile_of
from compiler.kernels import spec_round
from compiler.kernels.weight_layout import pack_for_device
from compiler.plan import NULL, BucketInput, BucketOutput, Call, RoundBuffer, Weight
from compiler.quant import QTensor
from compiler.round import plan_round
from compiler.spec import DRAFT_HEAD, load_spec
from compiler.targets import lookup
from ninfer_gen.cli.main import main
from ninfer_gen.weights.draft_vocab import DraftVocabError, load, rank, save

ROOT = Path(__file__).resolve().parent.parent
TINY = load_spec(ROOT / "model_specs/qwen3.8-tiny.yaml")


def test_rank_orders_by_count_then_id_and_tops_up():
    ids, counted = rank(list, [[5, 3, 3, 9], [9, 3, 7]], 4, 10)
    assert ids == [3, 9, 5, 7] and counted == 7
    ids, _ = rank(list, [[4, 4]], 3, 10)
    assert ids == [4, 0, 1]                                # unseen ids fill up, lowest first
    with pytest.raises(DraftVocabError, match="size 11"):
        rank(list, [], 11, 10)


def test_draft_vocab_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "draft_vocab.json"
    save(path, [3, 1, 2], 10, ["a.py"])
    assert load(path, 8) == [3, 1, 2] and load(tmp_path, 8) == [3, 1, 2]
    with pytest.raises(DraftVocabError, match="below 3"):
        load(path, 3)
    path.write_text(json.dumps({"format": "other"}))
    with pytest.raises(DraftVocabError, match="not a draft vocabulary"):
        load(path, 8)
    with pytest.raises(DraftVocabError, match="not found"):
        load(tmp_path / "missing.json", 8)


def test_draft_vocab_command(tmp_path, capsys):
    (tmp_path / "a.py").write_text("def f(x):\n    return x + x\n" * 20)
    out = tmp_path / "dv.json"
    assert main(["draft-vocab", str(tmp_path), "--size", "16", "--out", str(out)]) == 0
    ids = load(out, 8192)
    assert len(ids) == 16 and "the 16 most frequent" in capsys.readouterr().out
    assert main(["draft-vocab", str(tmp_path / "nothing"), "--size", "16", "--out", str(out)]) == 2


def test_draft_head_is_the_lm_head_rows_bit_for_bit():
    from ninfer_gen.executor.device_weights import from_host
    from ninfer_gen.executor.draft_head import IDS, add_draft_head
    from ninfer_gen.weights.checkpoint import quantize_weights
    from ninfer_gen.weights.random_weights import random_weights

    q = quantize_weights(TINY, random_weights(TINY, seed=0))
    dw = from_host(TINY, q, device="cpu")
    ids = [511, 0, 17, 256, 255, 3, 100, 400, 16, 15]
    add_draft_head(dw, ids, chunk_rows=128)                 # several chunks, rows from each
    head = q["lm_head.weight"]
    want = pack_for_device(QTensor(head.fmt, head.codes[ids], head.scales[ids]))
    got = dw.matrices[DRAFT_HEAD]
    assert all(torch.equal(got[p], want[p]) for p in want) and dw.tensors[IDS].tolist() == ids


def test_kquant_draft_head_is_the_lm_head_rows_bit_for_bit():
    """A GGUF's k-quant LM head (device layout: 16-row tile order): the draft head is its rows `ids`, each super-block
    byte for byte, packed again in tile order (the plane the GEMV reads)."""
    from types import SimpleNamespace

    from compiler.kernels.weight_layout import pack_kquant_for_device
    from compiler.kquant import KQTensor, random_kquant
    from ninfer_gen.executor.draft_head import IDS, add_draft_head

    spec = SimpleNamespace(model=SimpleNamespace(vocab_size=600, hidden_size=512, tie_word_embeddings=False))
    ids = [599, 0, 17, 256, 255, 3, 100, 400, 16, 15, 591]
    for fmt in ("q4_k", "q6_k"):
        head = random_kquant(fmt, 600, 512, torch.Generator().manual_seed(2))
        dw = SimpleNamespace(spec=spec, formats={"lm_head.weight": fmt}, tensors={},
                             matrices={"lm_head.weight": pack_kquant_for_device(head)})
        add_draft_head(dw, ids)
        want = pack_kquant_for_device(KQTensor(fmt, head.blocks[ids], 512))
        assert torch.equal(dw.matrices[DRAFT_HEAD]["lo"], want["lo"]) and dw.formats[DRAFT_HEAD] == fmt
        assert dw.tensors[IDS].tolist() == ids


def test_mtp_plan_and_round_over_the_draft_rows():
    target = lookup("rtx3090")
    profile = profile_of(TINY, cohorts=(1, 2), draft=3, draft_vocab=64)
    plan = plan_bucket(TINY, target, "mtp", 2, 1, profile)
    assert plan.outputs["logits"].shape == (2, 64)
    head = [c for c in plan.calls if any(isinstance(b, Weight) and b.name == DRAFT_HEAD for _, b in c.args)]
    assert len(head) == 1 and head[0].key.n == 64
    r = plan_round(TINY, target, profile, 2, "greedy")
    drafts = [c for c in r.calls() if c.key.family == "spec_round" and c.key.stage == "draft"]
    assert [c.key.j for c in drafts] == [0, 1, 2] and all(c.binding("ids") == Weight("mtp.draft_ids", "tensor")
                                                          for c in drafts)
    full = plan_round(TINY, target, profile_of(TINY, cohorts=(2,), draft=3), 2, "greedy")
    assert all(c.binding("ids") == NULL for c in full.calls() if "ids" in dict(c.args))


@pytest.mark.parametrize("acceptance", ["greedy", "sampled", "coin"])
def test_round_plan_order_and_bindings(acceptance):
    """Fused with a commit step (fold_in_verify off; its rounds: tests/test_fold_in_verify.py): the fold first,
    then begin → verify → the choice → accept → MTP over the committed slots → per draft the choice and the draft
    step, a chained MTP step between drafts; eager: no fold. Every parameter bound; what a call writes for the
    next entry is that entry's input."""
    profile = profile_of(TINY, cohorts=(1,), draft=3, accept_coin=True, options=CompileOptions(fold_in_verify=False))
    fused = plan_round(TINY, lookup("h200"), profile, 1, acceptance)
    steps = [s if isinstance(s, tuple) else (s.key.family, getattr(s.key, "stage", "")) for s in fused.steps]
    choice = ("spec_round", "probs") if acceptance == "sampled" else ("argmax", "")
    assert steps == [("commit", 1, 4), ("spec_round", "begin"), ("verify", 1, 4), choice, ("spec_round", "accept"),
                     ("mtp", 1, 4)] + [choice, ("spec_round", "draft"), ("mtp", 1, 1)] * 2 + \
        [choice, ("spec_round", "draft")]
    assert all(s.programmatic for s in fused.calls())       # h200: the round's calls wait inside (pdl_entry)
    eager = plan_round(TINY, lookup("h200"), profile, 1, acceptance, fold=False)
    assert eager.steps[0] != ("commit", 1, 4) and len(eager.steps) == len(fused.steps) - 1
    accept = next(c for c in fused.calls() if getattr(c.key, "stage", "") == "accept")
    assert accept.binding("fold_commit") == BucketInput(("commit", 1, 4), "commit")
    assert accept.binding("in_hidden") == BucketInput(("mtp", 1, 4), "hidden")
    assert accept.binding("hidden") == BucketOutput(("verify", 1, 4), "hidden")
    for c in fused.calls():
        assert all(isinstance(c, Call) for c in fused.calls())
        assert all(b != NULL or n in ("ids", "best", "p_dist", "q_dist", "drawn") or n.startswith("in_")
                   for n, b in c.args), c.key.name
    assert set(fused.buffers) >= {"round", "tables"} and fused.buffers["round"][0] == (1, spec_round.ROW_WORDS)
    assert RoundBuffer("round") in {b for c in fused.calls() for _, b in c.args}


def test_profile_rounds_and_build_keys():
    profile = profile_of(TINY, cohorts=(1, 2, 4, 8), draft=3)
    assert profile.rounds() == [(b, a) for b in (1, 2, 4, 8) for a in ("greedy", "sampled")]
    assert profile_of(TINY, cohorts=(1,), draft=0).rounds() == []
    rounds = plan_rounds(TINY, lookup("rtx3090"), profile_of(TINY, cohorts=(1, 8), draft=3, accept_coin=True))
    assert sorted(rounds) == [(b, a) for b in (1, 8) for a in ("coin", "greedy", "sampled")]
    with pytest.raises(ValueError, match="no speculative rounds"):
        plan_round(TINY, lookup("rtx3090"), profile_of(TINY, cohorts=(1,), draft=0), 1)
