"""data.mix: named sources mixed at their weights, and what each became (its share of samples
and tokens, logged and written to the run config).

Each source gets its share of data.num_samples (largest remainder, so the counts are within
one sample of the weights). A source with fewer conversations than its share shrinks the whole
mix rather than letting the others fill in: the weights hold, the total is logged.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..config import DataConfig, MixSourceConfig
from .conversations import Conversation
from .files import read_conversations


def mix_quotas(weights: list[float], total: int) -> list[int]:
    """Counts summing to `total`, each within 1 of total * weight / sum(weights)."""
    s = sum(weights)
    exact = [total * w / s for w in weights]
    out = [math.floor(x) for x in exact]
    by_rest = sorted(range(len(weights)), key=lambda i: (out[i] - exact[i], i))
    for i in by_rest[: total - sum(out)]:
        out[i] += 1
    return out


def source_config(dcfg: DataConfig, m: MixSourceConfig, num_samples: int) -> DataConfig:
    """One mix source as a data config of its own (the other data.* keys shared)."""
    return replace(
        dcfg,
        source=m.source,
        paths=list(m.paths),
        format=m.format,
        prompt_field=m.prompt_field,
        code_dirs=list(m.code_dirs),
        num_samples=num_samples,
        mix=[],
    )


def training_conversations(dcfg: DataConfig, log=print) -> tuple[list[Conversation], list[int]]:
    """The conversations training reads (any text source, or data.mix), and each one's source
    index in data.mix (0 without a mix)."""
    if dcfg.source != "mix":
        convs = read_conversations(dcfg, log)
        return convs, [0] * len(convs)
    return mixed_conversations(dcfg, log)


def mixed_conversations(dcfg: DataConfig, log=print) -> tuple[list[Conversation], list[int]]:
    weights = [m.weight for m in dcfg.mix]
    quotas = mix_quotas(weights, dcfg.num_samples)
    got = [
        read_conversations(source_config(dcfg, m, q), log) if q else []
        for m, q in zip(dcfg.mix, quotas)
    ]
    short = [i for i, (g, q) in enumerate(zip(got, quotas)) if len(g) < q]
    if short:
        total = min(math.floor(len(g) * sum(weights) / w) for g, w in zip(got, weights))
        while any(q > len(g) for q, g in zip(mix_quotas(weights, total), got)):
            total -= 1
        names = ", ".join(f"{dcfg.mix[i].name} has {len(got[i])} of {quotas[i]}" for i in short)
        quotas = mix_quotas(weights, total)
        log(
            f"data.mix: too few conversations ({names}): the mix keeps its weights with "
            f"{total} samples instead of data.num_samples={dcfg.num_samples}"
        )
        got = [g[:q] for g, q in zip(got, quotas)]
    if not sum(quotas):
        raise ValueError("data.mix: no conversations in any source (the dataset is empty)")
    log(
        "data.mix: "
        + ", ".join(
            f"{m.name} {q} conversations ({q / sum(quotas):.1%})" for m, q in zip(dcfg.mix, quotas)
        )
    )
    return [c for g in got for c in g], [i for i, g in enumerate(got) for _ in g]


def mix_report(samples: list, dcfg: DataConfig) -> dict:
    """Each source's samples, tokens and answer tokens (the loss falls on those) and their
    shares, from the samples the run trains on."""
    names = [m.name for m in dcfg.mix] or [dcfg.source]
    rows = {n: {"samples": 0, "tokens": 0, "answer_tokens": 0} for n in names}
    for s in samples:
        r = rows[names[s.source]]
        r["samples"] += 1
        r["tokens"] += int(s.input_ids.numel())
        r["answer_tokens"] += int(s.loss_mask.sum())
    totals = {
        k: max(sum(r[k] for r in rows.values()), 1) for k in ("samples", "tokens", "answer_tokens")
    }
    for r in rows.values():
        for k, t in totals.items():
            r[f"{k}_share"] = round(r[k] / t, 4)
    return rows


def data_figures(samples: list, cfg) -> dict:
    """What run_config.json records of the data beside the config: data_mix under data.mix."""
    return {"data_mix": mix_report(samples, cfg.data)} if cfg.data.mix else {}


def mix_line(report: dict) -> str:
    return "data.mix shares: " + ", ".join(
        f"{n} {r['samples_share']:.1%} of samples, {r['tokens_share']:.1%} of tokens "
        f"({r['answer_tokens_share']:.1%} of answer tokens)"
        for n, r in report.items()
    )
