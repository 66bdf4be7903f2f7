"""Batches: collation/packing of token samples, and the batch the target produces for training.

Legend: N rows, T positions, F = K*H aux features.
A row holds one sample (padding) or several (packing); segment_ids_NT tells them apart (-1 =
padding) and position_ids restart at 0 for every sample. The target always runs each sample
alone (unpacked), so no target layer (attention or Gated-DeltaNet recurrence) ever mixes
samples; the drafter's masks keep samples apart through segment_ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch


@dataclass
class Sample:
    sample_id: int
    input_ids: torch.Tensor  # [L] long: prompt + response
    loss_mask: torch.Tensor  # [L] bool: True on response tokens


@dataclass
class TokenBatch:
    input_ids_NT: torch.Tensor
    position_ids_NT: torch.Tensor
    segment_ids_NT: torch.Tensor
    loss_mask_NT: torch.Tensor
    sample_ids: torch.Tensor  # [S] ids of the samples, in order of appearance
    row_seeds: list = field(default_factory=list)

    def to(self, device) -> TokenBatch:
        return replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )


@dataclass
class TargetBatch(TokenBatch):
    """A TokenBatch plus what the clean target forward produced for it.

    next_token_NT is computed once, from the clean forward, before any noise: `noised` records
    whether aux_NTF was perturbed afterwards, and label derivation refuses noised batches
    computed any other way (labels from noised inputs are not what the target would predict)."""

    aux_NTF: torch.Tensor | None = None
    next_token_NT: torch.Tensor | None = None
    final_hidden_NTH: torch.Tensor | None = None
    noised: bool = False

    @property
    def num_tokens(self) -> int:
        return int((self.segment_ids_NT >= 0).sum())


def collate(samples: list[Sample], pad_id: int = 0, pack_to: int | None = None) -> TokenBatch:
    """Pad each sample to its own row, or (pack_to=L) first-fit pack samples into rows of L."""
    rows: list[list[Sample]] = [[s] for s in samples]
    if pack_to is not None:
        rows = []
        fill: list[int] = []
        for s in samples:
            n = s.input_ids.numel()
            for r, used in enumerate(fill):
                if used + n <= pack_to:
                    rows[r].append(s)
                    fill[r] += n
                    break
            else:
                rows.append([s])
                fill.append(n)
    T = max(sum(s.input_ids.numel() for s in row) for row in rows)
    N = len(rows)
    ids = torch.full((N, T), pad_id, dtype=torch.long)
    pos = torch.zeros(N, T, dtype=torch.long)
    seg = torch.full((N, T), -1, dtype=torch.long)
    lm = torch.zeros(N, T, dtype=torch.bool)
    order, seeds = [], []
    for r, row in enumerate(rows):
        o = 0
        for s in row:
            n = s.input_ids.numel()
            ids[r, o : o + n] = s.input_ids
            pos[r, o : o + n] = torch.arange(n)
            seg[r, o : o + n] = len(order)
            lm[r, o : o + n] = s.loss_mask
            order.append(s.sample_id)
            o += n
        seeds.append(row[0].sample_id)
    return TokenBatch(ids, pos, seg, lm, torch.tensor(order, dtype=torch.long), seeds)


def unpack(batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Rows -> one right-padded row per sample: ids [S, L], attention mask [S, L], and for each
    sample (row, start, length) to scatter results back."""
    spans = []
    for r in range(batch.input_ids_NT.shape[0]):
        seg = batch.segment_ids_NT[r]
        for s in seg[seg >= 0].unique(sorted=True).tolist():
            idx = (seg == s).nonzero().flatten()
            spans.append((r, int(idx[0]), int(idx.numel())))
    L = max(n for _, _, n in spans)
    ids = torch.zeros(len(spans), L, dtype=torch.long, device=batch.input_ids_NT.device)
    att = torch.zeros(len(spans), L, dtype=torch.long, device=batch.input_ids_NT.device)
    for i, (r, o, n) in enumerate(spans):
        ids[i, :n] = batch.input_ids_NT[r, o : o + n]
        att[i, :n] = 1
    return ids, att, spans


def repack(x_SL: torch.Tensor, spans: list, N: int, T: int, fill=0) -> torch.Tensor:
    out = x_SL.new_full((N, T) + tuple(x_SL.shape[2:]), fill)
    for i, (r, o, n) in enumerate(spans):
        out[r, o : o + n] = x_SL[i, :n]
    return out


def target_forward(target, batch: TokenBatch, with_final_hidden: bool = False) -> TargetBatch:
    """Run the clean target forward for a (possibly packed) batch, sample by sample."""
    N, T = batch.input_ids_NT.shape
    ids, att, spans = unpack(batch)
    out = target.capture(
        ids, att if bool((att == 0).any()) else None, with_final_hidden=with_final_hidden
    )
    tb = TargetBatch(**{f.name: getattr(batch, f.name) for f in fields(TokenBatch)})
    tb.aux_NTF = repack(out.aux_NTF, spans, N, T)
    tb.next_token_NT = repack(out.next_token_NT, spans, N, T)
    if out.final_hidden_NTH is not None:
        tb.final_hidden_NTH = repack(out.final_hidden_NTH, spans, N, T)
    return tb


def add_input_noise(
    batch: TargetBatch, std: float, generator: torch.Generator | None = None
) -> TargetBatch:
    """Input-side augmentation: Gaussian noise on the aux features, relative to their RMS.
    Labels (next_token_NT) are carried over untouched from the clean forward."""
    if std <= 0:
        return batch
    aux = batch.aux_NTF
    rms = aux.float().pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.randn(
        aux.shape, generator=generator, device=generator.device if generator else aux.device
    )
    noisy = (aux.float() + std * rms * noise).to(aux.dtype)
    return replace(batch, aux_NTF=noisy, noised=True)
