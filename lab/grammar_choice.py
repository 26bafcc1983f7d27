"""grammar_choice: xgrammar against llguidance for structured output, measured on this project's tokenizers —
tokenizer preparation, grammar compile time per schema, the per-token mask time along a valid output, the
process's memory growth, and whether each runs with no network (sockets refused). Each library runs in its
own fresh process, so imports and memory do not mix.

    python -m lab.grammar_choice                        # the small model's tokenizer (8,192 ids)
    python -m lab.grammar_choice --big                  # also a 248,320-id byte-level BPE (the 27B's vocab size)
    python -m lab.grammar_choice --json out.json        # the rows as JSON

xgrammar is not a dependency of the project: `.venv/bin/pip install xgrammar` first (it brings transformers,
apache-tvm-ffi and triton); a library that fails to import is reported and skipped.

There is no Qwen3.5 tokenizer in this repository or the HF cache (and no network to fetch one), so `--big`
trains a byte-level BPE of exactly 248,320 ids on this venv's Python sources (~40 s on 2 cores, cached in
build/lab/big_tokenizer.json). Its tokens are code and English pieces, not Qwen's multilingual ones: the
vocabulary's size and byte-level form are what the mask time depends on, and those are the 27B's.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMALL = REPO / "models" / "qwen3.8-small-py" / "tokenizer.json"
BIG = REPO / "build" / "lab" / "big_tokenizer.json"
BIG_VOCAB = 248_320

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
NESTED = {"type": "object", "additionalProperties": False, "required": ["id", "status", "items", "owner"],
          "properties": {
              "id": {"type": "integer", "minimum": 0}, "status": {"enum": ["open", "closed", "pending"]},
              "score": {"type": "number", "minimum": 0, "maximum": 1},
              "items": {"type": "array", "minItems": 1, "items": {
                  "type": "object", "required": ["sku", "qty"], "additionalProperties": False,
                  "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                 "qty": {"type": "integer", "minimum": 1}, "gift": {"type": "boolean"}}}},
              "owner": {"type": "object", "required": ["name"], "properties": {
                  "name": {"type": "string", "maxLength": 40}, "email": {"type": "string", "format": "email"}}},
              "tags": {"type": "array", "items": {"type": "string"}}}}
TOOLS = [("get_weather", WEATHER),
         ("search", {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                     "required": ["query"]}),
         ("create_order", NESTED)]
CALL = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": s},
                   "required": ["name", "arguments"], "additionalProperties": False} for n, s in TOOLS]}
SAMPLES = {
    "weather": ({"city": "Paris", "days": 3}, WEATHER),
    "nested": ({"id": 42, "status": "open", "score": 0.5, "items": [{"sku": "ABC-1234", "qty": 2, "gift": True},
                                                                    {"sku": "XYZ-0001", "qty": 1}],
                "owner": {"name": "Ada Lovelace", "email": "ada@example.com"}, "tags": ["a", "bb"]}, NESTED),
    "json_object": ({"anything": [1, 2.5, None, {"deep": "value"}], "ok": False}, {"type": "object"}),
}
TOOL_TEXT = '<tool_call>\n' + json.dumps({"name": "search", "arguments": {"query": "grammar engines",
                                                                          "limit": 5}}) + '\n</tool_call>'
SEPARATORS = (", ", ": ")          # json.dumps's, the chat template's tojson: no free whitespace to wander in


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _no_network() -> list[str]:
    """Refuses every socket connection and name lookup from here on; returns the list of attempts."""
    import socket

    attempts: list[str] = []

    def refuse(*args, **kw):
        attempts.append(repr(args[:2]))
        raise OSError("network disabled by lab.grammar_choice")

    socket.socket.connect = refuse
    socket.socket.connect_ex = refuse
    socket.getaddrinfo = refuse
    socket.create_connection = refuse
    return attempts


# ------------------------------------------------------------------ one library in this process

class _Llg:
    name = "llguidance"

    @staticmethod
    def imports() -> None:
        importlib.import_module("llguidance")   # not llguidance.torch: it pulls in torch.compile, +2 s, +150 MB

    def __init__(self, path: Path, vocab: int, eos: int):
        import llguidance
        import torch

        self.llg, self.torch = llguidance, torch
        self.tok = llguidance.LLTokenizer(path.read_text(), n_vocab=vocab, eos_token=eos)
        self.vocab = vocab

    def compile(self, kind: str, schema):
        m = self.llg.LLMatcher
        opts = {"whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]}
        if kind == "tool":
            grammar = m.grammar_from_lark('start: "<tool_call>\\n" call "\\n</tool_call>"\n'
                                          f'call: %json {json.dumps({**CALL, "x-guidance": opts})}\n')
        else:
            grammar = m.grammar_from_json_schema(schema, defaults=opts)
        matcher = m(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    @staticmethod
    def matcher(compiled):
        return compiled.deep_copy()          # a request's matcher: a copy of the pristine one

    def walk(self, matcher, tokens: list[int]) -> list[float]:
        mask = self.torch.full((1, (self.vocab + 31) // 32), -1, dtype=self.torch.int32)
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            times.append(time.perf_counter() - t0)
            if not (int(mask[0, t // 32]) >> (t % 32)) & 1 or not matcher.consume_token(t):
                raise RuntimeError(f"token {t} refused: {matcher.get_error()}")
        return times


class _Xgr:
    name = "xgrammar"
    dynamic = False             # xgrammar-dynamic: token masks built on first use instead of at compile

    @staticmethod
    def imports() -> None:
        importlib.import_module("transformers")
        importlib.import_module("xgrammar")

    def __init__(self, path: Path, vocab: int, eos: int):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False,
                                                 enable_dynamic_compilation=self.dynamic)
        self.vocab = vocab

    def compile(self, kind: str, schema):
        x = self.xgr
        if kind == "tool":
            body = x.Grammar.from_json_schema(json.dumps(CALL), any_whitespace=False, separators=SEPARATORS)
            grammar = x.Grammar.concat(x.Grammar.from_ebnf('root ::= "<tool_call>\\n"'), body,
                                       x.Grammar.from_ebnf('root ::= "\\n</tool_call>"'))
            compiled = self.compiler.compile_grammar(grammar)
        else:
            compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                         separators=SEPARATORS)
        self.last_bytes = compiled.memory_size_bytes
        return compiled

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def walk(self, matcher, tokens: list[int]) -> list[float]:
        mask = self.xgr.allocate_token_bitmask(1, self.vocab)
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - t0)
            if not (int(mask[0, t // 32]) >> (t % 32)) & 1 or not matcher.accept_token(t):
                raise RuntimeError(f"token {t} refused")
        return times


class _XgrDynamic(_Xgr):
    name = "xgrammar-dynamic"
    dynamic = True


LIBS = {c.name: c for c in (_Llg, _Xgr, _XgrDynamic)}


def measure(lib: str, path: Path, repeat: int) -> dict:
    """Everything about one library and one tokenizer (run in a fresh process)."""
    attempts = _no_network()
    os.environ["HF_HUB_OFFLINE"] = "1"
    importlib.import_module("torch")        # the engine has it loaded already: not counted
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    vocab = tok.get_vocab_size()
    cls = LIBS[lib]
    rss0, t0 = _rss(), time.perf_counter()
    cls.imports()
    import_s, import_mb = time.perf_counter() - t0, (_rss() - rss0) / 2 ** 20
    rss0, t0 = _rss(), time.perf_counter()
    engine = cls(path, vocab, tok.token_to_id("<|endoftext|>"))
    row = {"library": lib, "tokenizer": path.name, "vocab": vocab, "import_s": import_s, "import_rss_mb": import_mb,
           "init_s": time.perf_counter() - t0, "init_rss_mb": (_rss() - rss0) / 2 ** 20, "schemas": {}}
    cases = [(name, "schema", schema, json.dumps(sample, separators=SEPARATORS))
             for name, (sample, schema) in SAMPLES.items()] + [("tool_call_3", "tool", None, TOOL_TEXT)]
    for name, kind, schema, text in cases:
        before = _rss()
        compile_s = []
        for _ in range(repeat):              # a cold compile each time (no cache across these)
            t0 = time.perf_counter()
            compiled = engine.compile(kind, schema)
            compile_s.append(time.perf_counter() - t0)
        tokens = tok.encode(text).ids
        cold = engine.walk(engine.matcher(compiled), tokens)      # the first output under a new grammar
        warm = engine.walk(engine.matcher(compiled), tokens)      # a later request with the same grammar
        row["schemas"][name] = {
            "compile_ms": 1e3 * statistics.median(compile_s), "tokens": len(tokens),
            "cold_walk_ms": 1e3 * sum(cold), "mask_us_mean": 1e6 * statistics.fmean(warm),
            "mask_us_p50": 1e6 * statistics.median(warm), "mask_us_max": 1e6 * max(warm),
            "rss_mb": (_rss() - before) / 2 ** 20,
            "grammar_mb": getattr(engine, "last_bytes", 0) / 2 ** 20 or None}
    row["network_attempts"] = attempts
    return row


def build_big(out: Path) -> None:
    """A 248,320-id byte-level BPE trained on this venv's and the system's Python sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    roots = [Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"]
    files = sorted({str(p) for r in roots for p in r.rglob("*.py") if p.stat().st_size < 2_000_000})
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BIG_VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    if tok.get_vocab_size() != BIG_VOCAB:
        raise SystemExit(f"the corpus gave {tok.get_vocab_size()} ids, not {BIG_VOCAB}: add sources")
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))


def _table(rows: list[dict]) -> str:
    lines = ["| library | vocab | import s / MB | tokenizer s / MB | schema | compile ms | first output: "
             "compile + masks ms | next request's mask µs mean / p50 / max | tokens | grammar MB |", "|---" * 10 + "|"]
    for r in rows:
        for name, s in r["schemas"].items():
            mb = s["grammar_mb"] if s["grammar_mb"] is not None else s["rss_mb"]
            lines.append(f"| {r['library']} | {r['vocab']:,} | {r['import_s']:.2f} / {r['import_rss_mb']:.0f} | "
                         f"{r['init_s']:.2f} / {r['init_rss_mb']:.0f} | {name} | {s['compile_ms']:.1f} | "
                         f"{s['compile_ms'] + s['cold_walk_ms']:.1f} | {s['mask_us_mean']:.0f} / "
                         f"{s['mask_us_p50']:.0f} / {s['mask_us_max']:.0f} | {s['tokens']} | {mb:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--big", action="store_true", help="also the 248,320-id tokenizer (trained on first use)")
    ap.add_argument("--repeat", type=int, default=3, help="cold compiles per schema (the median is kept)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--one", nargs=2, metavar=("LIB", "TOKENIZER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], Path(args.one[1]), args.repeat)))
        return
    paths = [SMALL]
    if args.big:
        if not BIG.is_file():
            t0 = time.perf_counter()
            build_big(BIG)
            print(f"trained {BIG} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        paths.append(BIG)
    rows = []
    for path in paths:
        for lib in LIBS:
            out = subprocess.run([sys.executable, "-m", "lab.grammar_choice", "--one", lib, str(path),
                                  "--repeat", str(args.repeat)], cwd=REPO, capture_output=True, text=True)
            if out.returncode:
                print(f"{lib} on {path.name} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(_table(rows))
    for r in rows:
        print(f"{r['library']} ({r['vocab']:,}): network attempts with sockets refused: {r['network_attempts'] or 'none'}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
