"""Eval sets: held-out prompts (never training rows), the target's greedy completion of each and
the aux states along it, cached on disk keyed by everything that changes them.

Legend: P prompt length, L completion length, T = P + L.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

from safetensors.torch import load_file, save_file

from ..common.storage import usual_mode, writing
from ..config import EVAL_BEFORE_THE_KEY, EVAL_NOT_IN_SET_KEY, TARGET_EXECUTION_ONLY
from ..data.dataset import generate_greedy, keyed_settings
from ..data.files import text_prompts
from ..data.mix import training_conversations
from ..data.prompts import encode_prompts, random_prompts
from ..target.load import concrete_settings
from .greedy import EvalItem, checked_items, consistent_greedy  # noqa: F401 (re-exported)
from .heldout import set_conversations


def _eval_key(ecfg, skip: tuple[str, ...] = ()) -> dict:
    """The eval settings that change an eval set (its cache's name)."""
    # a key added since eval sets were first named (EVAL_BEFORE_THE_KEY: the value every set had
    # before it) is in the name only when set otherwise, so older caches keep their names
    return keyed_settings(vars(ecfg), (*EVAL_NOT_IN_SET_KEY, *skip), EVAL_BEFORE_THE_KEY)


# (the eval sets answer every turn that fits: data.max_turns is training's)
DATA_NOT_IN_KEY = (
    "cache_dir",
    "pack_to",
    "regen_compact",
    "regen_compile",
    "regen_fuse",
    "max_turns",
)


def eval_prompts(cfg, target, exclude_training: bool = True) -> list[list[int]]:
    ecfg, dcfg = cfg.eval, cfg.data
    source = ecfg.source or dcfg.source
    if source == "selfgen":
        return random_prompts(
            ecfg.num_prompts, dcfg.prompt_len, target.vocab_size, [target.mask_token_id], ecfg.seed
        )
    if target.tokenizer is None:
        raise ValueError(f"eval source {source!r} needs a target with a tokenizer")
    return encode_prompts(heldout_text_prompts(cfg, exclude_training), target.tokenizer, cfg.target)


def _prompt_key(p) -> str:
    return json.dumps(p, sort_keys=True, default=str)


def heldout_text_prompts(cfg, exclude_training: bool = True) -> list:
    """Eval prompts that are never training prompts: from eval.paths / eval.source when they
    name another source (refused if they overlap the training prompts), else the rows of the
    training source after the ones training uses, with any prompt that training also sees
    removed. exclude_training=False (a published drafter: its training prompts are unknown):
    data.* names the eval prompts themselves, whatever data.num_samples says."""
    from dataclasses import replace

    ecfg, dcfg = cfg.eval, cfg.data
    source = ecfg.source or dcfg.source
    if source == "mix":
        raise ValueError(
            "data.source=mix: name the eval prompts with eval.sets (e.g. a held-out slice of one "
            "source: {name: chat, source: jsonl, paths: [...], heldout: true}) or eval.source"
        )
    if not exclude_training:
        ed = replace(dcfg, source=source, paths=list(ecfg.paths or dcfg.paths))
        return text_prompts(replace(ed, num_samples=ecfg.num_prompts, seed=ecfg.seed))
    if ecfg.paths or source != dcfg.source:
        ed = replace(
            dcfg,
            source=source,
            paths=list(ecfg.paths),
            num_samples=ecfg.num_prompts,
            seed=ecfg.seed,
        )
        out = text_prompts(ed)[: ecfg.num_prompts]
        if dcfg.source != "selfgen":  # random token prompts never equal text prompts
            seen = {_prompt_key(c.prompt(dcfg.turns)) for c in training_conversations(dcfg)[0]}
            both = sum(_prompt_key(p) in seen for p in out)
            if both:
                raise ValueError(
                    f"eval.paths/eval.source: {both} of {len(out)} eval prompts are also training "
                    f"prompts of data.paths/data.source={dcfg.source} {list(dcfg.paths)}; point "
                    "eval.paths at held-out prompts"
                )
        return out
    seen = {_prompt_key(p) for p in text_prompts(dcfg)}
    pool = text_prompts(replace(dcfg, num_samples=dcfg.num_samples + ecfg.num_prompts))
    out = [p for p in pool if _prompt_key(p) not in seen][: ecfg.num_prompts]
    if not out:
        raise ValueError(
            f"eval: no held-out prompts left: data.source={dcfg.source} has no rows beyond the "
            f"{dcfg.num_samples} used for training; lower data.num_samples or set eval.paths "
            "/ eval.source"
        )
    return out


def build_eval_set(
    cfg,
    target,
    cache_dir: str | None,
    log=print,
    exclude_training: bool = True,
    read_dirs: tuple[str, ...] = (),
) -> list[EvalItem]:
    """The cached eval set of this config from cache_dir or read_dirs (eval.py: the run's own
    cache, where the in-loop eval left it), else built and saved in cache_dir."""
    key = {
        "format": 2,  # items carry final_LH
        "exclude_training": exclude_training,
        "eval": _eval_key(cfg.eval),
    }

    def build():
        prompts = eval_prompts(cfg, target, exclude_training)
        return _greedy_items(cfg, target, prompts, log)

    return _cached(cfg, target, key, "eval", build, cache_dir, read_dirs, log)


def build_eval_sets(
    cfg,
    target,
    cache_dir: str | None,
    log=print,
    exclude_training: bool = True,
    read_dirs: tuple[str, ...] = (),
) -> dict[str, list[EvalItem]]:
    """Every eval set by name: eval.sets, or the one unnamed set of eval.source / eval.paths."""
    if not cfg.eval.sets:
        return {"": build_eval_set(cfg, target, cache_dir, log, exclude_training, read_dirs)}
    return {
        es.name: build_named_set(cfg, es, target, cache_dir, log, read_dirs) for es in cfg.eval.sets
    }


def build_named_set(cfg, es, target, cache_dir, log=print, read_dirs=()) -> list[EvalItem]:
    """One set of eval.sets: its prompts (first user turns, or every turn after the target's
    own earlier answers), the target's greedy completions, cached like build_eval_set."""
    from dataclasses import asdict

    say = lambda msg: log(f"eval set {es.name}: {msg}")  # noqa: E731
    key = {
        "format": 3,
        "set": {k: v for k, v in asdict(es).items() if k not in EVAL_NOT_IN_SET_KEY},
        "eval": _eval_key(cfg.eval, ("sets",)),
    }

    def build():
        if es.source == "selfgen":
            num = es.num_prompts or cfg.eval.num_prompts
            ids = random_prompts(
                num, cfg.data.prompt_len, target.vocab_size, [target.mask_token_id], cfg.eval.seed
            )
            return _greedy_items(cfg, target, ids, say)
        if target.tokenizer is None:
            raise ValueError(f"eval.sets[{es.name}] needs a target with a tokenizer")
        convs = set_conversations(cfg, es, say)
        if es.turns == "each":
            return _turn_items(cfg, target, convs, say)
        prompts = encode_prompts([c.prompt("first") for c in convs], target.tokenizer, cfg.target)
        return _greedy_items(cfg, target, prompts, say)

    return _cached(cfg, target, key, f"eval-{es.name}", build, cache_dir, read_dirs, say)


def _cached(cfg, target, key: dict, stem: str, build, cache_dir, read_dirs, log) -> list[EvalItem]:
    names = _set_names(cfg, target, key, stem)
    dirs = [d for d in (cache_dir, *read_dirs) if d]
    for d in dirs:
        for name in names:
            if os.path.exists(path := os.path.join(d, name)):
                items = load_eval_set(path)
                log(f"eval: {len(items)} prompts from cache {path}")
                if d == cache_dir and not os.path.exists(tokens_path(path)):  # an older cache
                    _save(_token_tensors(items), tokens_path(path))
                return items
    tokens = (os.path.join(d, tokens_path(n)) for d in dirs for n in names)
    found = next((p for p in tokens if os.path.exists(p)), None)
    if found:  # the same prompts and completions; the states recomputed on this machine
        t0 = time.perf_counter()
        log(f"eval: no cache; the target's states along the prompts and completions of {found}")
        items = checked_items(target, load_eval_tokens(found), t0, log)
    else:
        items = build()
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
        save_eval_set(items, os.path.join(cache_dir, names[0]))
    return items


def _set_names(cfg, target, key: dict, stem: str) -> tuple[str, str]:
    """The eval set's cache name, and its name before 2026-12-07 (still read), when the target's
    execution-only settings (TARGET_EXECUTION_ONLY: the sets are built eagerly, one row at a
    time) keyed it too. Where the data cache lives, how training batches are packed and the
    static decoder's options change nothing of an eval set either. device and dtype "auto" are
    named as resolved here (a CPU's float32 set is not a GPU's bfloat16 one)."""
    data = {k: v for k, v in vars(cfg.data).items() if k not in DATA_NOT_IN_KEY}
    names = []
    for skip, settings in (
        (TARGET_EXECUTION_ONLY, concrete_settings(cfg.target)),
        ((), vars(cfg.target)),
    ):
        tgt = {k: v for k, v in settings.items() if k not in skip}
        text = json.dumps(
            {**key, "data": data, "target": tgt, "layers": target.layer_ids},
            sort_keys=True,
            default=str,
        )
        names.append(f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.safetensors")
    return names[0], names[1]


def _greedy_items(cfg, target, prompts, log) -> list[EvalItem]:
    t0 = time.perf_counter()
    comps = generate_greedy(
        target, prompts, cfg.eval.completion_len, cfg.eval.batch_size, desc="eval greedy", log=log
    )
    rounds, bs = cfg.eval.near_tie_rounds, cfg.eval.batch_size
    return checked_items(target, list(zip(prompts, comps)), t0, log, rounds, bs)


def _turn_items(cfg, target, convs, log) -> list[EvalItem]:
    """Every user turn of the conversations as a prompt: the target answers them in order
    (greedy, eval.completion_len tokens each, the conversation cut at data.max_length), each
    turn's prompt holding its own earlier answers, as in training with data.turns=all."""
    from ..data.rounds import run_turns
    from ..data.turns import encode_turns

    t0 = time.perf_counter()
    tp = encode_turns(convs, target.tokenizer, cfg.target, "all", cfg.data.max_length)
    if not tp:
        raise ValueError(
            f"eval: none of the set's {len(convs)} conversations has a first turn within "
            f"data.max_length={cfg.data.max_length} tokens; raise data.max_length or the set's "
            "num_prompts"
        )

    def generate(prompts, k, _convs):
        return generate_greedy(
            target,
            prompts,
            cfg.eval.completion_len,
            cfg.eval.batch_size,
            desc=f"eval greedy turn {k + 1}",
            log=log,
        )

    seqs, spans, _, _ = run_turns(tp, generate, cfg.data.max_length, target.tokenizer.eos_token_id)
    pairs = [(seq[:a], seq[a:b]) for seq, sp in zip(seqs, spans) for a, b in sp]
    log(f"{len(pairs)} turns of {len(tp)} conversations")
    return checked_items(target, pairs, t0, log, cfg.eval.near_tie_rounds, cfg.eval.batch_size)


def tokens_path(path: str) -> str:
    """The eval set's prompts and completions alone, next to its cache (`eval-...-HASH.tokens
    .safetensors`, ~1 % of it): without the cache (deleted, or a run directory copied without
    it) the set is rebuilt from them, the same text on any machine; only the states are
    recomputed (regenerating the completions could change them at a near-tie)."""
    return path.removesuffix(".safetensors") + ".tokens.safetensors"


def save_eval_set(items: list[EvalItem], path: str) -> None:
    """The eval set's cache, and its tokens file (`tokens_path`)."""
    _save(t := _token_tensors(items), tokens_path(path))
    for i, it in enumerate(items):  # the cache: the tokens and the states along them
        t[f"{i}.aux"] = it.aux_TF.contiguous()
        if it.final_LH is not None:
            t[f"{i}.final"] = it.final_LH.contiguous()
    _save(t, path)


def _token_tensors(items: list[EvalItem]) -> dict:
    t = {}
    for i, it in enumerate(items):
        t[f"{i}.prompt"], t[f"{i}.completion"] = it.prompt_ids, it.completion_ids
    return t


def _save(t: dict, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with writing(path):
            save_file(t, tmp)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    usual_mode(tmp)
    os.replace(tmp, path)


def _load(path: str) -> tuple[dict, int]:
    try:
        t = load_file(path)
    except Exception as e:  # safetensors raises several types for a damaged file
        raise ValueError(
            f"the eval-set cache {path} is damaged ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:120]}); delete it and start again: it is rebuilt"
        ) from None
    return t, len({k.split(".")[0] for k in t})


def load_eval_set(path: str) -> list[EvalItem]:
    t, n = _load(path)
    return [
        EvalItem(t[f"{i}.prompt"], t[f"{i}.completion"], t[f"{i}.aux"], t.get(f"{i}.final"))
        for i in range(n)
    ]


def load_eval_tokens(path: str) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) token lists of a tokens file (`tokens_path`)."""
    t, n = _load(path)
    return [(t[f"{i}.prompt"].tolist(), t[f"{i}.completion"].tolist()) for i in range(n)]
