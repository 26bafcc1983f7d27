"""run_cohort: `ninfer-gen run` with several prompts (`--prompt` repeated or `--prompts-file`) — one cohort
through engine.Engine (ReferenceLanes on the reference backend, lanes.gpu on the GPU), each
request streamed to its own labelled lines, or one JSON object per request; `--image`s go with every prompt."""
from __future__ import annotations

import sys

COHORT_LANES = 8      # `run`'s default cohort: one lane per prompt, at most this many


def prompts_of(args) -> list[str]:
    """--prompt as often as given, then --prompts-file's lines (blank lines skipped)."""
    from pathlib import Path

    prompts = list(args.prompt or [])
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise ValueError(f"no such prompts file: {path}")
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"no prompts in {path} (one per line; blank lines are skipped)")
        prompts += lines
    if not prompts:
        raise ValueError("give a prompt: --prompt TEXT (repeat it for several) or --prompts-file FILE")
    if args.lanes is not None and args.lanes < 1:
        raise ValueError(f"--lanes must be ≥ 1, got {args.lanes}")
    return prompts


def cohort_size(args, prompts: list[str]) -> int:
    """The lanes of the run: --lanes, else one per prompt up to COHORT_LANES (1 for a single prompt)."""
    return args.lanes or min(len(prompts), COHORT_LANES)


def run_cohort(model, args, prompts: list[str], params, draft: int, images=None) -> int:
    """Several prompts (or --json): one cohort through the Engine, each prompt behind the `images`' placeholder
    blocks (vision.preprocess.Processed; None: text only). Exit 2 if a request failed."""
    tok, eos = model.tokenizer, model.eos_ids
    ids = [tok.encode(p) for p in prompts]
    if images is not None:
        ids = [model.image_prompt(x, images) for x in ids]
    for i, x in enumerate(ids, 1):
        if not x:
            raise ValueError(f"prompt {i} is empty")
    outs = [_Labelled(i, p, tok, eos, args.json, draft) for i, p in enumerate(prompts, 1)]
    from ninfer_gen.engine import Engine, Request

    lanes = cohort_size(args, prompts)
    engine = Engine(model.lanes(lanes), lanes=lanes, max_queue=len(prompts), adaptive_draft=not args.fixed_draft)
    handles = [engine.submit(Request(x, args.max_tokens, params, eos, draft, images=images)) for x in ids]
    while engine.step():
        for handle, out in zip(handles, outs):
            for event in handle.poll():
                out.feed(event)
    return 2 if any(out.final.finish == "error" for out in outs) else 0


class _Labelled:
    """One request's output: `[i] ` lines (its prompt, then the completion as lines complete), or with
    --json one object when it ends; a summary on stderr."""

    def __init__(self, index: int, prompt: str, tok, eos: set[int], as_json: bool, draft: int):
        self.index, self.tok, self.eos, self.json, self.draft = index, tok, eos, as_json, draft
        self.prompt_text, self.tokens, self.text, self.line, self.final = prompt, [], "", prompt, None

    def feed(self, event) -> None:
        self.tokens += event.tokens
        text = self.tok.decode([t for t in self.tokens if t not in self.eos])
        if event.finish or not text.endswith("\ufffd"):     # wait for the rest of a multi-byte character
            self.line += text[len(self.text):]
            self.text = text
        if not self.json:
            *done, self.line = self.line.split("\n")
            for line in done:
                print(f"[{self.index}] {line}", flush=True)
        if event.finish:
            self._end(event)

    def _end(self, event) -> None:
        import json

        self.final, s = event, event.stats
        ttft = None if s.ttft_s is None else round(s.ttft_s * 1e3, 1)
        if self.json:
            print(json.dumps({"index": self.index, "text": self.text, "tokens": self.tokens, "ttft_ms": ttft,
                              "decode_tok_s": round(s.decode_tok_s, 2),
                              "acceptance": round(s.acceptance, 4) if self.draft else None,
                              "tokens_per_round": round(s.tokens_per_round, 3) if self.draft else None,
                              "prompt_tokens": s.prompt_tokens, "finish": event.finish, "error": event.error}),
                  flush=True)
        else:
            print(f"[{self.index}] {self.line}", flush=True)
        spec = (f"; acceptance {s.acceptance:.1%}, {s.tokens_per_round:.2f} tokens per round over {s.rounds} rounds"
                if self.draft else "")
        print(f"[{self.index}: {s.prompt_tokens} prompt tokens, {s.tokens} new tokens; time to first token "
              f"{'-' if ttft is None else f'{ttft:.0f}'} ms; decode {s.decode_tok_s:.1f} tok/s{spec}; {event.finish}]",
              file=sys.stderr)
        if event.error:
            print(f"error: prompt {self.index}: {event.error}", file=sys.stderr)
