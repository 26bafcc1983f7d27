"""device_state: the buffers the kernels read and write across calls, in the kernels' layouts —
`DeviceState` (per attention layer, the MTP layer's included, K and V pages [pages, Hkv, page, D]: INT8
codes + fp16 scales per 64 values, or bf16; per GDN layer the conv history [slots, width−1, C] bf16, the
recurrent state [slots, Hv, Dk, Dv] fp32 and, for speculative rounds, the ReplaySSM records of a verify
of `record_rows` × `record_tokens` (conv columns, raw k, v bf16; (g, beta) fp32); one trash page for
padded rows) — and `StepInputs`, one bucket's per-run values (token ids, row positions, block table,
slots, key counts, commit counts; with images the M-RoPE positions and the image-token count) in one int32 device
buffer, plus tensor inputs (the MTP's hidden, a prompt piece's image tokens).

The graph's reference layouts (`trace.state_avals`) are not used here: agreement with the reference
interpreter is checked on outputs (logits), not on state bytes.
"""
from __future__ import annotations

import torch

from compiler.plan import STEP_INPUTS
from compiler.spec import ModelSpec


TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "i32": torch.int32, "i8": torch.int8}


class ExecutableError(RuntimeError):
    pass


class DeviceState:
    """KV pages and GDN state slots in the kernels' layouts."""

    def __init__(self, spec: ModelSpec, num_pages: int, num_slots: int, kv_dtype: str = "int8", device="cuda",
                 record_rows: int = 0, record_tokens: int = 0, snapshots: bool = False, record_sets: int = 1):
        """`num_pages` usable pages plus one trash page (the last) for padded rows and warm-up runs;
        `record_sets` 2: a second set of ReplaySSM records (`rec1.*`: rounds that fold inside the next verify
        write the two sets in turn, CompileOptions.fold_in_verify)."""
        a, at, g = spec.model, spec.model.attention, spec.model.linear_attention
        page = spec.runtime.page_size
        self.num_pages, self.num_slots, self.kv_dtype = num_pages, num_slots, kv_dtype
        self.trash_page = num_pages
        num_pages += 1
        self.kv: dict[str, dict[str, torch.Tensor]] = {}
        self.conv: dict[str, torch.Tensor] = {}
        self.ssm: dict[str, torch.Tensor] = {}
        self.records: dict[str, dict[str, torch.Tensor]] = {}
        self.records1: dict[str, dict[str, torch.Tensor]] = {}      # the second set (record_sets = 2)
        pages = (num_pages, at.num_kv_heads, page, at.head_dim)
        if a.mtp.num_layers:
            self.kv["mtp"] = self._kv_layer(pages, kv_dtype, device)
        for i, kind in enumerate(a.layers.kinds):
            if kind == "full_attention":
                self.kv[str(i)] = self._kv_layer(pages, kv_dtype, device)
            else:
                if record_rows and record_tokens and snapshots:    # the snapshot design: states, columns
                    rt = (record_rows, record_tokens)
                    self.records[str(i)] = {
                        "conv": torch.zeros(*rt, g.conv_dim, dtype=torch.bfloat16, device=device),
                        "snap": torch.zeros(*rt, g.num_value_heads, g.key_head_dim, g.value_head_dim,
                                            dtype=torch.float32, device=device)}
                elif record_rows and record_tokens:
                    rt = (record_rows, record_tokens)
                    for store in (self.records, self.records1)[:record_sets]:
                        store[str(i)] = {
                            "conv": torch.zeros(*rt, g.conv_dim, dtype=torch.bfloat16, device=device),
                            "k": torch.zeros(*rt, g.num_key_heads, g.key_head_dim, dtype=torch.bfloat16, device=device),
                            "v": torch.zeros(*rt, g.num_value_heads, g.value_head_dim, dtype=torch.bfloat16,
                                             device=device),
                            "g": torch.zeros(*rt, g.num_value_heads, 2, dtype=torch.float32, device=device)}
                self.conv[str(i)] = torch.zeros(num_slots, g.conv_kernel - 1, g.conv_dim, dtype=torch.bfloat16,
                                                device=device)
                self.ssm[str(i)] = torch.zeros(num_slots, g.num_value_heads, g.key_head_dim, g.value_head_dim,
                                               dtype=torch.float32, device=device)

    @staticmethod
    def _kv_layer(pages, kv_dtype, device) -> dict[str, torch.Tensor]:
        if kv_dtype == "int8":
            scales = (*pages[:3], pages[3] // 64)
            return {"k": torch.zeros(pages, dtype=torch.int8, device=device),
                    "v": torch.zeros(pages, dtype=torch.int8, device=device),
                    "k_scales": torch.zeros(scales, dtype=torch.float16, device=device),
                    "v_scales": torch.zeros(scales, dtype=torch.float16, device=device)}
        return {"k": torch.zeros(pages, dtype=torch.bfloat16, device=device),
                "v": torch.zeros(pages, dtype=torch.bfloat16, device=device)}

    def buffer(self, name: str) -> torch.Tensor:
        """A state buffer by its plan name: `kv.<layer>.k|v|k_scales|v_scales`, `gdn.<layer>.state|conv`,
        `rec.<layer>.conv|k|v|g` (and `rec1.…`, the second set), `snap.<layer>` (snapshot mode)."""
        kind, layer, part = (name.split(".") + ["", ""])[:3]
        try:
            if kind == "kv":
                return self.kv[layer][part]
            if kind in ("rec", "rec1"):
                return (self.records if kind == "rec" else self.records1)[layer][part]
            if kind == "snap":
                return self.records[layer]["snap"]
            if kind == "gdn" and part in ("state", "conv"):
                return (self.ssm if part == "state" else self.conv)[layer]
        except KeyError:
            pass
        raise ExecutableError(f"no state buffer {name!r} (KV layers {', '.join(self.kv) or 'none'}, "
                              f"GDN layers {', '.join(self.ssm) or 'none'}, KV dtype {self.kv_dtype}, "
                              f"records {'kept' if self.records else 'none: no speculative rounds'})")

    def reset_slot(self, slot: int) -> None:
        for t in (*self.conv.values(), *self.ssm.values()):
            t[slot].zero_()

    def tensors(self) -> list[torch.Tensor]:
        return [*(t for layer in self.kv.values() for t in layer.values()), *self.conv.values(), *self.ssm.values(),
                *(t for store in (self.records, self.records1) for layer in store.values() for t in layer.values())]

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.tensors()]

    def restore(self, snap: list[torch.Tensor]) -> None:
        for t, s in zip(self.tensors(), snap):
            t.copy_(s)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


OPTIONAL_INPUTS = ("mrope", "image_count", "coords", "cu_seqlens")   # only in the buffers of plans that read them


class StepInputs:
    """One bucket's per-run values in one int32 device buffer (one host→device copy per run)."""

    def __init__(self, batch: int, tokens: int, max_pages: int, trash_page: int, device,
                 tensors: dict[str, tuple[tuple[int, ...], str]] | None = None, used=()):
        """`tensors`: name → (shape, dtype) of the other inputs (plan.step_tensors()); `used`: the int32 inputs
        the plan reads (plan.step_inputs()) — every STEP_INPUTS buffer is kept, but OPTIONAL_INPUTS only where
        read (a text plan's buffer is what it was)."""
        self.batch, self.tokens, self.max_pages, self.trash_page = batch, tokens, max_pages, trash_page
        self._layout = {name: size(batch, tokens, max_pages) for name, size in STEP_INPUTS.items()
                        if name not in OPTIONAL_INPUTS or name in used}
        self.tensors = {name: torch.zeros(shape, dtype=TORCH_DTYPES[dt], device=device)
                        for name, (shape, dt) in (tensors or {}).items()}
        self.host = torch.zeros(sum(self._layout.values()), dtype=torch.int32)
        self.device = torch.zeros_like(self.host, device=device)
        self.views, self.host_views, at = {}, {}, 0
        for name, n in self._layout.items():
            self.views[name], self.host_views[name] = self.device[at:at + n], self.host[at:at + n]
            at += n

    def ptr(self, name: str) -> int:
        found = self.views.get(name, self.tensors.get(name))
        if found is None:
            raise ExecutableError(f"no step input {name!r} (have {', '.join([*self.views, *self.tensors])})")
        return found.data_ptr()

    def set_commit(self, counts: list[int]) -> None:
        """Commit counts of the rows (a fold's `commit`); padded rows 0."""
        self.host_views["commit"].zero_()
        self.host_views["commit"][:len(counts)] = torch.tensor(counts, dtype=torch.int32)
        self.views["commit"].copy_(self.host_views["commit"])

    def set_images(self, rows: torch.Tensor | None) -> None:
        """The image tokens of this run's placeholders ([n, hidden], in order; None: none), into the `images`
        tensor and its `image_count` (a run with placeholders but no images here keeps their embeddings). Call
        after `set`, which zeroes the count."""
        n = 0 if rows is None else rows.shape[0]
        if not n:                                    # `set` left the count at 0: no copy on a decode step
            return
        if "image_count" not in self.views:
            raise ExecutableError("this bucket takes no images (a profile without images)")
        if n > self.tensors["images"].shape[0]:
            raise ExecutableError(f"{n} image tokens exceed the bucket's {self.tensors['images'].shape[0]}")
        self.tensors["images"][:n].copy_(rows)
        self.host_views["image_count"][0] = n
        self.views["image_count"].copy_(self.host_views["image_count"])

    def set(self, tokens: list[list[int]], starts: list[int], tables: list[list[int]], slots: list[int],
            rope: list | None = None) -> None:
        """Rows of T tokens at positions start…start+T−1. Padded rows (fewer than `batch`) get slot −1
        (the GDN kernels skip them), no keys, and a block table of the trash page (their KV writes land
        there); so does the rest of every row's block table. A plan with M-RoPE gets each row's 3-axis
        positions: `rope[r]` (compiler.multimodal.RopePositions, or None) gives them, else all three axes are
        the row's positions."""
        b, t, h = self.batch, self.tokens, self.host_views
        if len(tokens) > b or any(len(row) != t for row in tokens):
            raise ExecutableError(f"bucket ({b}×{t}) got {len(tokens)} rows of {[len(r) for r in tokens]} tokens")
        self.host.zero_()
        h["slots"].fill_(-1)
        h["block_table"].fill_(self.trash_page)
        for r, (row, start, table, slot) in enumerate(zip(tokens, starts, tables, slots)):
            if len(table) > self.max_pages:
                raise ExecutableError(f"block table of {len(table)} pages exceeds the bucket's {self.max_pages}")
            h["tokens"][r * t:(r + 1) * t] = torch.tensor(row, dtype=torch.int32)
            h["row_pos"][r * t:(r + 1) * t] = torch.arange(start, start + t, dtype=torch.int32)
            h["pos"][r] = start
            h["block_table"][r * self.max_pages:r * self.max_pages + len(table)] = torch.tensor(table, dtype=torch.int32)
            h["slots"][r] = slot
            h["seq_lens"][r] = start + t
            if "mrope" in h:
                at = rope[r] if rope is not None else None
                rows = at.rows(start, t) if at is not None else h["row_pos"][r * t:(r + 1) * t, None].expand(-1, 3)
                h["mrope"][3 * r * t:3 * (r + 1) * t] = rows.reshape(-1)
        self.device.copy_(self.host)
