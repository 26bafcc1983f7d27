"""draft_head: the MTP's reduced-vocabulary head on the device — the LM head's rows of the draft ids,
gathered from its packed planes (unpacked a chunk of tiles at a time, the rows kept, packed again: the
codes and scales are the LM head's, bit for bit) — plus the id map the round's draft step reads.
"""
from __future__ import annotations

import torch

from compiler.kernels.weight_layout import TILE, pack_for_device, pack_kquant_for_device, padded_rows, unpack_from_device
from compiler.kquant import KFORMATS, QK_K, KQTensor
from compiler.model import lm_head_name
from compiler.quant import QTensor
from compiler.spec import DRAFT_HEAD

IDS = "mtp.draft_ids"          # int32 [N]: draft row → token id (a `tensor` weight the round binds)


def add_draft_head(weights, ids: list[int], chunk_rows: int = 8192) -> None:
    """Add DRAFT_HEAD (rows `ids` of the LM head, same format) and IDS to device weights."""
    head = lm_head_name(weights.spec)
    fmt, planes = weights.formats[head], weights.matrices[head]
    vocab, hidden = weights.spec.model.vocab_size, weights.spec.model.hidden_size
    device = planes["lo"].device
    want = torch.tensor(ids, dtype=torch.int64, device=device)
    if fmt in KFORMATS:           # super-blocks as stored in 16-row tile order: row r is [r // 16, :, r % 16]
        units, qb = hidden // QK_K, KFORMATS[fmt].block_bytes
        rows = planes["lo"].view(padded_rows(vocab) // TILE, units, TILE, qb)[want // TILE, :, want % TILE]
        rows = rows.reshape(len(ids), units * qb)
        weights.matrices[DRAFT_HEAD] = pack_kquant_for_device(KQTensor(fmt, rows, hidden))
        weights.formats[DRAFT_HEAD] = fmt
        weights.tensors[IDS] = want.to(torch.int32)
        return
    tiles = padded_rows(vocab) // TILE
    codes, scales, order = [], [], []
    for r0 in range(0, vocab, chunk_rows):
        r1 = min(vocab, r0 + chunk_rows)
        t0, t1 = r0 // TILE, -(-r1 // TILE)
        part = {name: p.view(tiles, -1)[t0:t1].reshape(-1) if p.numel() else p for name, p in planes.items()}
        q = unpack_from_device(part, fmt, r1 - r0, hidden)
        sel = ((want >= r0) & (want < r1)).nonzero().flatten()
        if sel.numel():
            rows = want[sel] - r0
            codes.append(q[rows] if fmt == "bf16" else q.codes[rows])
            scales.append(None if fmt == "bf16" else q.scales[rows])
            order.append(sel)
    inverse = torch.argsort(torch.cat(order))
    if fmt == "bf16":
        gathered = torch.cat(codes)[inverse]
    else:
        gathered = QTensor(fmt, torch.cat(codes)[inverse].contiguous(), torch.cat(scales)[inverse].contiguous())
    weights.matrices[DRAFT_HEAD] = pack_for_device(gathered)
    weights.formats[DRAFT_HEAD] = fmt
    weights.tensors[IDS] = want.to(torch.int32)
