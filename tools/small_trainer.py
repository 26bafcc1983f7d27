"""small_trainer: the training loop of the small model — AdamW, warm-up + cosine LR over the run's
progress (wall clock, epochs or steps, whichever is nearest its limit), joint main + MTP loss,
gradient clipping, periodic evaluation and the training curve.

Calls `compiler.model.reference_forward` for the math; owns no model definition.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from compiler.model import reference_forward
from compiler.spec import ModelSpec

from .small_data import BatchSampler
from .small_eval import EvalSet, batch_losses, evaluate, progress_bar


@dataclass(frozen=True)
class TrainConfig:
    minutes: float
    max_epochs: float          # 0: no epoch limit
    max_steps: int             # 0: no step limit
    lr: float
    min_lr_ratio: float
    warmup: int
    weight_decay: float
    mtp_weight: float
    clip: float
    eval_every_s: float        # 0: evaluate only at the start and the end
    eval_batch: int
    log_every: int


def compute_view(params: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The weights the forward sees: on CUDA, matrices and conv in bf16 (differentiable casts of the
    fp32 masters; the model program then runs bf16 activations with its fp32 GDN state); on CPU fp32.
    Vectors (norms, A_log, dt_bias) stay fp32. Order is preserved (embedding first)."""
    if device.type != "cuda":
        return dict(params)
    return {k: v.to(torch.bfloat16) if v.dim() >= 2 else v for k, v in params.items()}


def make_optimizer(params: dict[str, torch.Tensor], cfg: TrainConfig, device: torch.device):
    """AdamW; weight decay on matrices only (not on norms, conv, A_log, dt_bias)."""
    decay = [p for p in params.values() if p.dim() == 2]
    other = [p for p in params.values() if p.dim() != 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine from lr to lr·min_lr_ratio as progress → 1."""
    floor = cfg.lr * cfg.min_lr_ratio
    cosine = floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cosine * min(1.0, (step + 1) / max(cfg.warmup, 1))


class Trainer:
    def __init__(self, cfg: TrainConfig, spec: ModelSpec, params: dict[str, torch.Tensor],
                 sampler: BatchSampler, evalsets: dict[str, EvalSet], device: torch.device, epoch_tokens: int):
        self.cfg, self.spec, self.params, self.sampler = cfg, spec, params, sampler
        self.evalsets, self.device, self.epoch_tokens = evalsets, device, epoch_tokens
        self.opt = make_optimizer(params, cfg, device)
        self.step, self.tokens, self.curve = 0, 0, []
        self.best = {"valid_bits_per_byte": float("inf"), "step": 0}
        self.best_params = None
        self.t0 = time.perf_counter()
        self.seconds = 0.0

    def progress(self) -> float:
        c = self.cfg
        fractions = [(time.perf_counter() - self.t0) / (c.minutes * 60)]
        if c.max_epochs:
            fractions.append(self.tokens / (c.max_epochs * self.epoch_tokens))
        if c.max_steps:
            fractions.append(self.step / c.max_steps)
        return max(fractions)

    def train_step(self) -> torch.Tensor:
        """One optimiser step; returns [loss, main CE, MTP CE] as a device tensor (no host sync)."""
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.cfg, self.step, self.progress())
        window = self.sampler.next()
        inputs, targets = window[:, :-1], window[:, 1:]
        out = reference_forward(self.spec, compute_view(self.params, self.device), inputs, with_mtp=True)
        main, mtp = batch_losses(out, inputs, targets)
        loss = main + self.cfg.mtp_weight * mtp
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.cfg.clip)
        self.opt.step()
        self.step += 1
        self.tokens += inputs.numel()
        return torch.stack([loss, main, mtp]).detach()

    def evaluate_all(self) -> dict:
        """Periodic evaluation (training precision); keeps a copy of the best weights by validation bpb."""
        view = compute_view(self.params, self.device)
        rec = {"step": self.step, "tokens": self.tokens, "elapsed_s": round(time.perf_counter() - self.t0, 1)}
        with torch.no_grad():
            for name, es in self.evalsets.items():
                m = evaluate(self.spec, view, es, self.cfg.eval_batch, self.device)
                rec[f"{name}_bits_per_byte"] = round(m["bits_per_byte"], 4)
                rec[f"{name}_mtp_agreement"] = round(m["mtp_agreement"], 4)
        if rec.get("valid_bits_per_byte", float("inf")) < self.best["valid_bits_per_byte"]:
            self.best = {"valid_bits_per_byte": rec["valid_bits_per_byte"], "step": self.step}
            self.best_params = {k: v.detach().clone() for k, v in self.params.items()}
        self.curve.append(rec)
        print("eval", rec, flush=True)
        return rec

    def _log(self, sums: torch.Tensor, n: int, t_last: float, tok_last: int) -> None:
        loss, main, mtp = (sums / n).tolist()
        now = time.perf_counter()
        rec = {"step": self.step, "tokens": self.tokens, "epoch": round(self.tokens / self.epoch_tokens, 3),
               "elapsed_s": round(now - self.t0, 1), "lr": self.opt.param_groups[0]["lr"],
               "loss": round(loss, 4), "train_loss": round(main, 4), "mtp_loss": round(mtp, 4),
               "tokens_per_s": round((self.tokens - tok_last) / max(now - t_last, 1e-9))}
        self.curve.append(rec)
        print("train", rec, flush=True)

    def run(self) -> None:
        """Train until the time, epoch or step budget is spent; evaluates at the start and the end."""
        self.evaluate_all()
        last_eval = time.perf_counter()
        sums, n, t_last, tok_last = torch.zeros(3, device=self.device), 0, time.perf_counter(), 0
        bar = progress_bar(total=100, desc="train", unit="%", mininterval=5)
        while self.progress() < 1.0:
            sums += self.train_step()
            n += 1
            bar.update(min(100, int(self.progress() * 100)) - bar.n)
            if n == self.cfg.log_every:
                self._log(sums, n, t_last, tok_last)
                sums, n, t_last, tok_last = torch.zeros(3, device=self.device), 0, time.perf_counter(), self.tokens
            if self.cfg.eval_every_s and time.perf_counter() - last_eval >= self.cfg.eval_every_s:
                self.evaluate_all()
                last_eval = time.perf_counter()
        if n:
            self._log(sums, n, t_last, tok_last)
        bar.close()
        self.evaluate_all()
        self.seconds = time.perf_counter() - self.t0
