"""Checkpoint format, eval.py end to end, and eval == training block machinery."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, make_drafter

from dflash.drafter.checkpoint import load_drafter, save_drafter
from dflash.eval.offline import draft_all_anchors
from dflash.eval.sets import EvalItem
from dflash.target.shape import Heads
from dflash.train.resume import save_checkpoint

EXPECTED_LAYER_KEYS = {
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
}


def test_serving_format(tiny_qwen, tmp_path):
    from safetensors import safe_open

    d = make_drafter(tiny_qwen)
    save_drafter(str(tmp_path), d)
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {
        "target_layer_ids": tiny_qwen.layer_ids,
        "mask_token_id": 511,
        "block_size": 4,
        "input_embedding_scale": 1.0,
        "output_multiplier": 1.0,
    }
    assert cfg["block_size"] == 4 and cfg["layer_types"] == ["sliding_attention", "full_attention"]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{k}" for i in range(2) for k in EXPECTED_LAYER_KEYS
    }
    assert keys == expected
    back, rep = load_drafter(str(tmp_path))
    assert rep["fc_input"] == 3 * 128 and not rep["missing"]
    # z-lab published directories may prefix keys with "model." and carry extra tensors
    for k, v in d.state_dict().items():
        assert torch.allclose(back.state_dict()[k], v.to(torch.bfloat16).float())


def test_checkpoint_files_get_the_usual_permissions(tiny_qwen, tmp_path):
    """safetensors writes 0600: a checkpoint (and the eval-set cache, also safetensors) would be
    unreadable to the rest of a group; every file gets what open() gives (0644 under umask 022)."""
    old = os.umask(0o022)
    try:
        p = save_checkpoint(str(tmp_path), 3, make_drafter(tiny_qwen), {"x": 1})
    finally:
        os.umask(old)
    for name in os.listdir(p):
        assert os.stat(os.path.join(p, name)).st_mode & 0o777 == 0o644, name


def test_atomic_checkpoint_leaves_no_partial(tiny_qwen, tmp_path):
    d = make_drafter(tiny_qwen)
    p = save_checkpoint(str(tmp_path), 3, d, {"x": 1}, keep_last=1)
    save_checkpoint(str(tmp_path), 5, d, {"x": 1}, keep_last=1)
    names = os.listdir(tmp_path / "checkpoints")
    assert sorted(names) == ["latest", "step_00000005"] and not os.path.exists(p)


def test_eval_drafts_equal_training_path(tiny_qwen):
    """The eval's cached-context pass over every anchor (blocks built by dflash.drafter.blocks,
    one batched forward) against a plain loop that runs each block alone with an explicit key
    list (tests/test_drafter.py::_reference, no shared block or mask code): the same log-probs
    over the whole vocabulary, the same drafts, at every anchor."""
    from test_drafter import _reference

    d = make_drafter(tiny_qwen, block_size=4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (1, 20), generator=g)
    aux = tiny_qwen.capture(ids).aux_NTF
    item = EvalItem(ids[0, :8], ids[0, 8:], aux[0])
    heads = Heads(tiny_qwen.embed_tokens, tiny_qwen.lm_head)
    V = tiny_qwen.vocab_size
    draft, lp, tk = draft_all_anchors(d, heads, item, top_k=V, anchor_chunk=5)
    with torch.no_grad():
        h = _reference(d, heads.embed, ids, aux, torch.arange(8, 20)[None])
        ref = torch.log_softmax(d.logits(h[:, 1:], heads.lm_head.weight), -1)  # [12, 3, V]
    got = torch.full_like(ref, float("nan")).scatter(-1, tk, lp)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)
    assert torch.equal(draft, ref.argmax(-1)) and lp.shape == (12, 3, V)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            "logger=none",
            f"out_root={out}",
            "run_name=r",
            "train.steps=20",
            "train.save_every=20",
            "train.eval_every=10",
            "train.keep_best=eval/tau",
            "data.num_samples=32",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return out / "r", r.stdout + r.stderr


def test_default_run_prints_loss_and_acceptance(trained_run):
    run_dir, stdout = trained_run
    assert "eval: streak" in stdout and "tau" in stdout
    # quiet start: the Gated-DeltaNet path in one line, no transformers fallback warnings
    gdn = [ln for ln in stdout.splitlines() if "Gated-DeltaNet" in ln]
    assert len(gdn) == 1 and "Gated-DeltaNet: torch fallback (chunk_gated_delta_rule" in gdn[0]
    assert "falling back to its reference PyTorch" not in stdout
    lines = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    assert any("train/loss" in x for x in lines) and any("eval/tau" in x for x in lines)


def test_eval_cli_table_and_json(trained_run, tmp_path):
    run_dir, _ = trained_run
    ck = run_dir / "checkpoints" / "step_00000020"
    out = tmp_path / "rep.json"
    r = subprocess.run(
        [
            sys.executable,
            "eval.py",
            f"ckpt={ck}",
            f"out={out}",
            f"out_root={tmp_path}",
            f"eval_dir={tmp_path}/ev",
            "logger=none",
            "eval.show_rounds=1",  # one eval key named: the run's other eval keys still apply
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "eval (but eval.show_rounds)" in r.stdout
    assert f"prompts from cache {run_dir}/data/eval-" in r.stdout  # the run's own eval set
    assert "Detected fc input: 384 = 3 target layers" in r.stdout
    assert "per prompt" in r.stdout and "summary" in r.stdout
    rep = json.load(open(out))
    assert {"streak", "tau", "dds@4", "acc_pos_1"} <= set(rep["summary"]) and rep["prompts"]
    assert rep["prompts"][0]["matches"]
    log = (tmp_path / "ev" / "eval.log").read_text()  # eval.py's console, in its own dir
    assert "Detected fc input: 384 = 3 target layers" in log and "summary" in log
    # the in-loop eval and eval.py agree exactly (same code path, same cached prompts, the
    # in-loop eval runs on the bf16-rounded weights the checkpoint exports)
    last = [json.loads(x) for x in open(run_dir / "metrics.jsonl") if "eval/tau" in x][-1]
    assert last["step"] == 20
    keys = [k for k in rep["summary"] if k.startswith(("acc_pos_", "dds@", "tau", "streak"))]
    assert {"acc_pos_1", "acc_pos_3", "tau", "dds@8"} <= set(keys)
    for k in keys:
        assert rep["summary"][k] == pytest.approx(last[f"eval/{k}"], abs=1e-9, nan_ok=True), k


def test_the_best_checkpoint_is_the_best_eval_and_eval_py_reproduces_it(trained_run, tmp_path):
    """train.keep_best=eval/tau: checkpoints/best is the drafter of the eval (after step 0) with
    the highest tau, named in the log, and eval.py on it gives that tau again."""
    run_dir, stdout = trained_run
    evals = [json.loads(x) for x in open(run_dir / "metrics.jsonl") if "eval/tau" in x]
    assert [e["step"] for e in evals] == [0, 10, 20]
    top = max(evals[1:], key=lambda e: e["eval/tau"])  # max() keeps the first of equals
    best = run_dir / "checkpoints" / "best"
    kept = json.load(open(best / "manifest.json"))["run"]
    assert kept == {"step": top["step"], "best_metric": "eval/tau", "best_value": top["eval/tau"]}
    assert f"best: {best} (eval/tau {top['eval/tau']:.4f} at step {top['step']})" in stdout
    out = tmp_path / "rep.json"
    r = subprocess.run(
        [sys.executable, "eval.py", f"ckpt={best}", f"out={out}", f"eval_dir={tmp_path}/ev"]
        + ["logger=none"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.load(open(out))["summary"]["tau"] == pytest.approx(top["eval/tau"], abs=1e-9)


def test_eval_cli_real_decoding(trained_run, tmp_path):
    """eval.real_decode_prompts=N: the greedy AR / chain / tree figures reach the JSON summary
    and print as one table; at float32 every output is AR's."""
    run_dir, _ = trained_run
    out = tmp_path / "rep.json"
    r = subprocess.run(
        [
            sys.executable,
            "eval.py",
            f"ckpt={run_dir / 'checkpoints' / 'latest'}",  # the README's form: a file
            f"out={out}",
            f"out_root={tmp_path}",
            f"eval_dir={tmp_path}/ev",
            "logger=none",
            "eval.num_prompts=2",
            "eval.completion_len=24",
            "eval.real_decode_prompts=2",
            "eval.decode_tree_budgets=[4]",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "real greedy decoding, first 2 prompts" in r.stdout
    assert "AR == cached greedy completion on 2/2" in r.stdout
    s = json.load(open(out))["summary"]
    for m in ("chain", "tree@4"):
        assert s[f"decode_identical_{m}"] == 2
        assert s[f"decode_tau_{m}"] == pytest.approx(s[f"decode_offline_tau_{m}"], abs=1e-12)
        assert s[f"decode_tokens_per_s_{m}"] > 0 and s[f"decode_speedup_{m}"] > 0
    assert s["decode_tokens_per_s_ar"] > 0


def test_eval_cli_real_decoding_per_set(trained_run, tmp_path):
    """A set's own real_decode_prompts overrides eval.real_decode_prompts: one eval.py call
    decodes one set for real and scores the other offline only (the target loads once)."""
    run_dir, _ = trained_run
    out = tmp_path / "rep.json"
    r = subprocess.run(
        [
            sys.executable,
            "eval.py",
            f"ckpt={run_dir / 'checkpoints' / 'latest'}",
            f"out={out}",
            f"out_root={tmp_path}",
            f"eval_dir={tmp_path}/ev",
            "logger=none",
            "eval.completion_len=24",
            "eval.real_decode_prompts=1",
            "eval.decode_tree_budgets=[4]",
            "eval.sets=[{name: dec, source: selfgen, num_prompts: 2}, "
            "{name: off, source: selfgen, num_prompts: 2, real_decode_prompts: 0}]",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.load(open(out))["summary"]
    assert r.stdout.count("real greedy decoding, first 1 prompts") == 1
    assert s["dec/decode_tokens_per_s_ar"] > 0 and s["dec/decode_identical_chain"] == 1
    assert not [k for k in s if k.startswith("off/decode_")]
    assert s["off/tau"] == pytest.approx(s["dec/tau"])  # the same selfgen prompts


def test_eval_set_real_decode_prompts_is_checked():
    from dflash.config import EvalConfig, EvalSetConfig

    with pytest.raises(ValueError, match=r"eval.sets\[0\].real_decode_prompts must be >= 0"):
        EvalConfig(
            sets=[EvalSetConfig(name="a", source="selfgen", real_decode_prompts=-1)]
        ).validate()


@pytest.mark.parametrize(
    "break_it,match",
    [
        ("corrupt", "not a readable safetensors"),
        ("flipped", "model.safetensors differs from its sha256 in manifest.json"),
        ("hidden", "hidden size"),
        ("vocab", "vocab"),
        ("layers", "final layer"),
        ("nojson", "no config.json"),
        ("fc", "fc input"),
    ],
)
def test_eval_cli_refuses_bad_checkpoints(trained_run, tmp_path, break_it, match):
    import shutil

    run_dir, _ = trained_run
    ck = tmp_path / "ck"
    shutil.copytree(run_dir / "checkpoints" / "step_00000020", ck)
    if break_it != "flipped":  # the other checks, on a directory without a manifest (published)
        os.remove(ck / "manifest.json")
    extra = []
    cfg = json.load(open(ck / "config.json"))
    if break_it == "corrupt":
        (ck / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    elif break_it == "flipped":  # 64 bytes flipped inside the weights: the file still parses
        data = bytearray((ck / "model.safetensors").read_bytes())
        for i in range(len(data) - 64, len(data)):
            data[i] ^= 0xFF
        (ck / "model.safetensors").write_bytes(bytes(data))
    elif break_it == "hidden":  # a target of another width
        extra = ["target.config.hidden_size=64", "target.config.head_dim=16"]
    elif break_it == "vocab":
        extra = ["target.config.vocab_size=1024"]
    elif break_it == "layers":
        cfg["dflash_config"]["target_layer_ids"] = [1, 3, 7]
    elif break_it == "fc":
        cfg["dflash_config"]["target_layer_ids"] = [1, 3]
    else:
        os.remove(ck / "config.json")
    if (ck / "config.json").exists() and break_it != "flipped":
        json.dump(cfg, open(ck / "config.json", "w"))
    r = subprocess.run(
        [
            sys.executable,
            "eval.py",
            f"ckpt={ck}",
            f"out_root={tmp_path}",
            f"eval_dir={tmp_path}/ev",
            "logger=none",
            "target=tiny_qwen3_5",
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0
    assert match in r.stderr and "Traceback" not in r.stderr, r.stderr[-1500:]
    assert not (tmp_path / "ev").exists()  # a refused checkpoint leaves no eval dir


def test_lost_latest_pointer_falls_back_to_newest_step(tiny_qwen, tmp_path):
    from dflash.common.layout import find_checkpoint

    d = make_drafter(tiny_qwen)
    save_checkpoint(str(tmp_path / "r"), 2, d, {})
    save_checkpoint(str(tmp_path / "r"), 4, d, {})
    os.remove(tmp_path / "r" / "checkpoints" / "latest")
    assert find_checkpoint(str(tmp_path / "r")).endswith("step_00000004")


def test_checkpoint_keeps_fp32_master_weights(tiny_qwen, tmp_path):
    from dflash.train.resume import load_checkpoint

    d = make_drafter(tiny_qwen)
    with torch.no_grad():
        d.fc.weight.add_(1e-4)  # not representable in bf16
    save_checkpoint(str(tmp_path), 1, d, {})
    cfg = json.load(open(tmp_path / "checkpoints" / "step_00000001" / "config.json"))
    assert cfg["torch_dtype"] == "bfloat16"
    fresh = make_drafter(tiny_qwen, seed=5)
    load_checkpoint(str(tmp_path), fresh)
    assert torch.equal(fresh.fc.weight, d.fc.weight)


def test_report_json_is_strict(tmp_path):
    from dflash.eval.report import write_json

    write_json(str(tmp_path / "r.json"), [], {"tau": float("nan"), "x": [1.0, float("inf")]}, {})
    assert json.load(open(tmp_path / "r.json"))["summary"] == {"tau": None, "x": [1.0, None]}


def test_per_prompt_table_columns_hold_their_own_values():
    """tau_t{T} is summary-only: the per-prompt table must not shift dds values under it."""
    from rich.console import Console

    from dflash.eval.report import print_report

    class Rep:
        def to_dict(self):
            return dict(
                prompt_id=0, num_rounds=3, streak=0.5, tau=1.5, matches=[], **{"dds@4": 0.25}
            )

    con = Console(width=200, record=True)
    print_report([Rep()], {"tau": 1.5, "tau_t0.7": 2.0, "dds@4": 0.25}, [4], console=con)
    lines = con.export_text().splitlines()
    head = next(x for x in lines if "dds@4" in x and "prompt" in x)
    row = next(x for x in lines if x.strip().startswith("│") and "1.500" in x)
    cols = [c.strip() for c in head.strip("┃ ").split("┃")]
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert dict(zip(cols, cells))["dds@4"] == "0.250"


def test_eval_cli_keeps_the_runs_eval_keys_it_is_not_told_to_change():
    """`eval.real_decode_prompts=4` alone must not swap the run's HumanEval eval set for the
    default one (it did: a named eval key dropped the whole restored group)."""
    from dflash.config import EvalConfig, RunConfig
    from dflash.eval.cli import _restore_group

    rc = RunConfig(eval=EvalConfig(real_decode_prompts=4))
    saved = {"source": "humaneval", "num_prompts": 164, "completion_len": 256, "gone_key": 1}
    out, label = _restore_group(rc, "eval", EvalConfig, saved, {"eval.real_decode_prompts"})
    assert (out.eval.source, out.eval.num_prompts, out.eval.completion_len) == (
        "humaneval",
        164,
        256,
    )
    assert out.eval.real_decode_prompts == 4
    assert label == "eval (but eval.real_decode_prompts)"


def _flip_inside(path, needle: bytes) -> None:
    """Flip the bytes of `needle` where it sits in the file: damage that still parses."""
    data = bytearray(path.read_bytes())
    at = data.find(needle)
    assert at > 0 and len(needle) == 64
    data[at : at + 64] = bytes(b ^ 0x5A for b in needle)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("which", ["train_state.pt", "model.safetensors"])
def test_flipped_bytes_in_a_checkpoint_are_refused_naming_the_file(tiny_qwen, tmp_path, which):
    """64 bytes flipped inside the weights load without an error from torch / safetensors (the
    resumed run or the eval would go on on other weights); the manifest's sha256 refuses them at
    resume, in eval.py's and drafter.init_from's load_drafter, naming the file."""
    from dflash.config import DrafterConfig, RunConfig
    from dflash.train.build import build_drafter
    from dflash.train.resume import load_checkpoint

    d = make_drafter(tiny_qwen)
    step = save_checkpoint(str(tmp_path), 3, d, {"x": 1})
    fc = d.fc.weight.detach().flatten()[:32]
    needle = (
        fc.numpy().tobytes()
        if which == "train_state.pt"
        else fc.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    )
    path = tmp_path / "checkpoints" / "step_00000003" / which
    _flip_inside(path, needle[:64])
    if which == "train_state.pt":  # still a readable train state, with other weights
        assert not torch.equal(
            torch.load(path, weights_only=False)["drafter_fp32"]["fc.weight"], d.fc.weight
        )
    loads = [lambda: load_checkpoint(step, make_drafter(tiny_qwen))]
    if which == "model.safetensors":
        loads.append(lambda: load_drafter(step))
        spec = d.spec
        dcfg = DrafterConfig(
            num_layers=spec.num_hidden_layers,
            layer_types=list(spec.layer_types),
            sliding_window=spec.sliding_window,
            target_layer_ids=list(spec.target_layer_ids),
            block_size=spec.block_size,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads,
            head_dim=spec.head_dim,
            intermediate_size=spec.intermediate_size,
            init_from=step,
        )
        loads.append(lambda: build_drafter(RunConfig(drafter=dcfg), tiny_qwen.shape))
    for load in loads:
        with pytest.raises(ValueError) as e:
            load()
        assert str(e.value).startswith(f"{path} differs from its sha256 in manifest.json"), e.value


def test_weights_holding_nan_are_refused_on_load(tiny_qwen, tmp_path):
    """A directory without a manifest (a published drafter) is still checked for NaN / inf."""
    d = make_drafter(tiny_qwen)
    with torch.no_grad():
        d.norm.weight[3] = float("nan")
    save_drafter(str(tmp_path), d, manifest=False)
    with pytest.raises(ValueError, match="1 weight tensor.s. hold NaN or inf .norm.weight."):
        load_drafter(str(tmp_path))
