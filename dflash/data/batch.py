"""Batches: collation/packing of token samples, and the batch the target produces for training.

Legend: N rows, T positions, F = K*H aux features.
A row holds one sample (padding) or several (packing); segment_ids_NT tells them apart (-1 =
padding) and position_ids restart at 0 for every sample. The target never mixes samples: a
target whose layers all attend runs them packed into as few rows as hold them (the attention
mask follows the restarting position ids: no padding is computed), any other (Gated-DeltaNet
recurrence) runs each sample in its own row. The drafter's masks keep samples apart through
segment_ids.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields, replace

import torch

from ..target.packing import packed_capture_agrees


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass
class Sample:
    sample_id: int
    input_ids: torch.Tensor  # [L] long: prompt + response
    loss_mask: torch.Tensor  # [L] bool: True on response tokens (the target's answers)
    source: int = 0  # index of its source in data.mix (0 without a mix)


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
                f.name: to_device(getattr(self, f.name), device)
                for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )


def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """Host -> GPU through pinned memory, asynchronously: a copy from pageable memory waits for
    the GPU queue to reach it, which stalls the host behind the previous step's kernels."""
    device = torch.device(device)
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


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
    # the token fields as they were on the host before the target forward: the trainer picks
    # anchors and labelled positions from them without reading anything back from the device
    host: TokenBatch | None = None

    def host_tokens(self) -> TokenBatch:
        """The token fields on the CPU: free when the batch kept its host copy (a colocated
        capture, a batch received from a worker) or is there, else one device->host copy."""
        if self.host is not None:
            return self.host
        if self.segment_ids_NT.device.type == "cpu":
            return self
        return TokenBatch(
            *(getattr(self, f.name).cpu() for f in fields(TokenBatch)[:5]), self.row_seeds
        )

    @property
    def num_tokens(self) -> int:
        return int((self.host_tokens().segment_ids_NT >= 0).sum())

    def greedy_agreement(self) -> torch.Tensor:
        """[response tokens that are the target's greedy token after the tokens before them,
        response tokens], float, on the batch's device (no host sync). 1 : 1 for answers the
        target regenerated, up to near-ties of the capture's numerics; less for text it did not
        write (data.answers=given with another model's or template's answers)."""
        seg, resp = self.segment_ids_NT, self.loss_mask_NT[:, 1:]
        resp = resp & (seg[:, 1:] == seg[:, :-1])
        hit = (self.next_token_NT[:, :-1] == self.input_ids_NT[:, 1:]) & resp
        return torch.stack([hit.sum(), resp.sum()]).float()


# below this share of response tokens that are the target's own greedy tokens, the first step
# warns: regenerated answers agree up to near-ties of the capture's numerics (bf16: ~1 %)
MIN_GREEDY_AGREEMENT = 0.9


def agreement_warning(agreement: float, given: bool, enable_thinking: bool) -> str | None:
    """A warning line when the training text (TargetBatch.greedy_agreement of the first step) is
    far from what the target itself would write; given: data.answers=given."""
    if agreement >= MIN_GREEDY_AGREEMENT:
        return None
    return (
        f"warning: only {agreement:.1%} of the first step's response tokens are the target's "
        "greedy tokens after the text before them: the drafter learns the target's labels, but "
        "on text the target would not write, so what it learns may not be what it is served. "
        + (
            "data.answers=given: were the answers generated by this target, with its chat "
            f"template (target.enable_thinking={enable_thinking}) and greedy decoding? If not, "
            "use data.answers=regenerate"
            if given
            else "The answers were regenerated by the target: a capture far from the "
            "regeneration's numerics (target.dtype, packing) or a chat template applied "
            "differently would do this"
        )
    )


def collate(
    samples: list[Sample],
    pad_id: int = 0,
    pack_to: int | None = None,
    pad_to: int | None = None,
    pad_rows: int | None = None,
) -> TokenBatch:
    """Pad each sample to its own row, or (pack_to=L) first-fit pack samples into rows of L.
    pad_to=L / pad_rows=N: at least L positions and N rows (static shapes for `train.compile`,
    where packing makes the row count vary; the padding is segment -1, which nothing attends to
    or is labelled on, and a padding row has no anchors)."""
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
    T = max(max(sum(s.input_ids.numel() for s in row) for row in rows), pad_to or 0)
    N = max(len(rows), pad_rows or 0)
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
    seeds += [-1 - r for r in range(N - len(rows))]  # padding rows: no sample, no anchors
    return TokenBatch(ids, pos, seg, lm, torch.tensor(order, dtype=torch.long), seeds)


def sample_spans(segment_ids_NT: torch.Tensor) -> list:
    """(row, start, length) of every sample, in order of appearance. Read from a host copy of
    the segment ids (free when the batch is still on the CPU; one copy otherwise)."""
    seg = segment_ids_NT.cpu()
    N, T = seg.shape
    if N * T == 0:
        return []
    # samples are contiguous runs of one segment id within a row; -1 is padding
    flat = seg.flatten()
    change = torch.ones(N * T, dtype=torch.bool)
    change[1:] = flat[1:] != flat[:-1]
    change[::T] = True  # a run never continues into the next row
    starts = change.nonzero().flatten()
    lengths = torch.diff(starts, append=torch.tensor([N * T]))
    keep = flat[starts] >= 0
    starts, lengths = starts[keep], lengths[keep]
    return list(zip((starts // T).tolist(), (starts % T).tolist(), lengths.tolist()))


def _span_index(spans: list, device, dest: list | None = None) -> tuple:
    """Index tensors that move every sample between its row slot and its own row (or, `dest`,
    the (row, offset) of each sample in another layout)."""
    rows, cols, src_s, src_l = [], [], [], []
    for i, (r, o, n) in enumerate(spans):
        d_row, d_off = dest[i] if dest is not None else (i, 0)
        rows.append(torch.full((n,), r))
        cols.append(torch.arange(o, o + n))
        src_s.append(torch.full((n,), d_row))
        src_l.append(torch.arange(d_off, d_off + n))
    cat = lambda xs: torch.cat(xs).to(device, non_blocking=True)  # noqa: E731
    return cat(rows), cat(cols), cat(src_s), cat(src_l)


def unpack(batch: TokenBatch, spans: list | None = None):
    """Rows -> one right-padded row per sample: ids [S, L], attention mask [S, L] (None when no
    sample is padded), for each sample (row, start, length), and the index tensors repack uses."""
    spans = sample_spans(batch.segment_ids_NT) if spans is None else spans
    L = max(n for _, _, n in spans)
    dev = batch.input_ids_NT.device
    index = _span_index(spans, dev)
    r, c, si, sl = index
    ids = torch.zeros(len(spans), L, dtype=torch.long, device=dev)
    ids[si, sl] = batch.input_ids_NT[r, c]
    att = None
    if any(n < L for _, _, n in spans):
        att = torch.zeros(len(spans), L, dtype=torch.long, device=dev)
        att[si, sl] = 1
    return ids, att, spans, index


def pack_for_capture(batch: TokenBatch, spans: list, rows_to: int = 1, len_to: int = 1):
    """Samples -> as few rows of the longest sample's length as hold them (first fit, longest
    first), position ids restarting at 0 for every sample and for the padding at a row's end:
    ids, position ids and segment ids (the sample's index, -1 = padding) [R, L], and the index
    tensors repack uses. rows_to / len_to: pad R and L up to multiples of them (CUDA graphs
    replay fixed shapes); padding rows are padding throughout."""
    L, fill, place = _place_samples(spans, rows_to, len_to)
    dev = batch.input_ids_NT.device
    host = _span_index(spans, torch.device("cpu"), place)
    pos = (torch.arange(L)[None] - torch.tensor(fill)[:, None]).clamp(min=0)
    pos[host[2], host[3]] = torch.cat([torch.arange(n) for _, _, n in spans])
    seg = torch.full((len(fill), L), -1, dtype=torch.long)
    seg[host[2], host[3]] = torch.cat([torch.full((n,), i) for i, (_, _, n) in enumerate(spans)])
    r, c, pr, pc = index = tuple(t.to(dev, non_blocking=True) for t in host)
    ids = torch.zeros(len(fill), L, dtype=torch.long, device=dev)
    ids[pr, pc] = batch.input_ids_NT[r, c]
    to_dev = lambda x: to_device(x, dev)  # noqa: E731
    return ids, to_dev(pos), to_dev(seg), index


def _place_samples(spans: list, rows_to: int = 1, len_to: int = 1):
    """pack_for_capture's placement, on the host: the row length L, the tokens used in each
    packed row (padded to a multiple of rows_to rows) and each sample's (packed row, offset)."""
    L = round_up(max(n for _, _, n in spans), len_to)
    fill: list[int] = []  # tokens used in each packed row
    place: list = [None] * len(spans)  # (packed row, offset) of each sample
    for i in sorted(range(len(spans)), key=lambda i: -spans[i][2]):
        n = spans[i][2]
        r = next((r for r, used in enumerate(fill) if used + n <= L), len(fill))
        if r == len(fill):
            fill.append(0)
        place[i], fill[r] = (r, fill[r]), fill[r] + n
    fill += [0] * (round_up(len(fill), rows_to) - len(fill))
    return L, fill, place


def repack(x_SL: torch.Tensor, index: tuple, N: int, T: int, fill=0) -> torch.Tensor:
    r, c, si, sl = (t.to(x_SL.device) for t in index)
    out = x_SL.new_full((N, T) + tuple(x_SL.shape[2:]), fill)
    out[r, c] = x_SL[si, sl]
    return out


def target_forward(target, batch: TokenBatch, with_final_hidden: bool = False) -> TargetBatch:
    """Run the clean target forward for a (possibly packed) batch: its samples packed into as
    few rows as hold them when every target layer attends (`target.packed_capture`, checked
    once against one sample per row), else one sample per row. Pass the batch while it is still
    on the CPU: the sample spans are then read without a device sync and the tokens move to the
    target's device once."""
    N, T = batch.input_ids_NT.shape
    spans = sample_spans(batch.segment_ids_NT)
    host = batch if batch.segment_ids_NT.device.type == "cpu" else None
    batch = batch.to(target.device)
    if getattr(target, "packs_capture", False):
        graphs = None if with_final_hidden else getattr(target, "capture_graphs", None)
        buckets = graphs.buckets if graphs is not None else ()
        ids, pos, seg, index = pack_for_capture(batch, spans, *buckets)
        if graphs is not None:  # CUDA graphs of fixed-shape buckets (dflash.target.graphs)
            out = graphs(ids, pos, seg)
        else:
            out = target.capture(ids, None, with_final_hidden, position_ids_NT=pos)
        pending = target.pack_check_pending
        shared_NT = _sharing_a_row(spans, N, T, *buckets) if pending else None
        if shared_NT is not None:  # once per target: the same outputs as one per row?
            u_ids, att, _, u_index = unpack(batch, spans)
            ref = target.capture(u_ids, att, with_final_hidden=True)  # + logits of near-ties
            if not packed_capture_agrees(
                target,
                [repack(x, index, N, T) for x in (out.aux_NTF, out.next_token_NT)],
                [repack(x, u_index, N, T) for x in (ref.aux_NTF, ref.next_token_NT)],
                repack(ref.final_hidden_NTH, u_index, N, T),
                shared_NT.to(out.aux_NTF.device),
            ):
                out, index = ref, u_index
                if not with_final_hidden:
                    out.final_hidden_NTH = None
    else:
        ids, att, spans, index = unpack(batch, spans)
        out = target.capture(ids, att, with_final_hidden=with_final_hidden)
    tb = TargetBatch(**{f.name: getattr(batch, f.name) for f in fields(TokenBatch)}, host=host)
    tb.aux_NTF = repack(out.aux_NTF, index, N, T)
    tb.next_token_NT = repack(out.next_token_NT, index, N, T)
    if out.final_hidden_NTH is not None:
        tb.final_hidden_NTH = repack(out.final_hidden_NTH, index, N, T)
    return tb


def _sharing_a_row(spans: list, N: int, T: int, rows_to=1, len_to=1) -> torch.Tensor | None:
    """[N, T] the positions (in the batch's layout) of the samples that share a packed row with
    another sample; None when every sample has a row of its own (nothing to check yet). Read
    from the host placement (`_place_samples`, the one pack_for_capture used), never from the
    device: while the check waits for such a batch, the capture must not sync with the GPU."""
    rows = [r for r, _ in _place_samples(spans, rows_to, len_to)[2]]
    per_row = Counter(rows)
    shared = [i for i, r in enumerate(rows) if per_row[r] >= 2]
    if not shared:
        return None
    mask = torch.zeros(N, T, dtype=torch.bool)
    for i in shared:
        r, o, n = spans[i]
        mask[r, o : o + n] = True
    return mask


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
