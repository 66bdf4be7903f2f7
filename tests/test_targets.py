"""The target: Gated-DeltaNet backend selection and its report, aux-state capture against a plain
HF forward, mask-token errors, config loading, and the parity checker."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import ROOT, get_target

from dflash.target.capture import resolve_mask_token_id
from dflash.target.linear_attn import (
    check_bound_backend,
    linear_attn_kind,
    linear_attn_report,
    select_linear_attn_backend,
)
from dflash.target.load import load_conf, target_config_from_yaml

CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- backend selection
def test_torch_chosen_on_cpu():
    assert select_linear_attn_backend("auto", CPU) == "torch"
    assert select_linear_attn_backend("torch", CPU) == "torch"


def test_fla_refused_without_cuda():
    with pytest.raises(
        ValueError, match="linear_attn_backend=fla needs a CUDA device.*linear_attn_backend=torch"
    ):
        select_linear_attn_backend("fla", CPU)
    with pytest.raises(ValueError, match="choose auto, fla or torch"):
        select_linear_attn_backend("triton", CPU)


def test_report_says_torch_fallback_on_cpu(tiny_qwen, tiny_llama):
    report = linear_attn_report()
    for op in (
        "chunk_gated_delta_rule",
        "recurrent_gated_delta_rule",
        "causal_conv1d_fn",
        "causal_conv1d_update",
    ):
        assert report[op].startswith("torch fallback ("), report
    assert "torch_chunk_gated_delta_rule" in report["chunk_gated_delta_rule"]
    assert linear_attn_kind(report) == "torch"
    assert tiny_qwen.backend == "torch"
    assert tiny_llama.backend == "none"  # no linear attention


def test_asking_fla_but_bound_to_torch_is_refused(tiny_qwen):
    with pytest.raises(ValueError, match="bound to torch"):
        check_bound_backend(tiny_qwen.model, "fla")


def test_report_reads_the_pre_5_15_layout():
    """Older transformers: `chunk_gated_delta_rule` is the fla kernel or None, next to a plain
    `torch_chunk_gated_delta_rule`; the model runs `kernel or torch_fn`."""
    import types

    def torch_chunk_gated_delta_rule():
        pass

    def chunk_gated_delta_rule():
        pass

    chunk_gated_delta_rule.__module__ = "fla.ops.gated_delta_rule.chunk"
    mod = types.ModuleType("transformers.models.qwen3_next.modeling_qwen3_next")
    torch_chunk_gated_delta_rule.__module__ = mod.__name__
    mod.torch_chunk_gated_delta_rule, mod.chunk_gated_delta_rule = (
        torch_chunk_gated_delta_rule,
        None,
    )
    mod.causal_conv1d_fn = None
    rep = linear_attn_report(mod)
    assert (
        rep["chunk_gated_delta_rule"].startswith("torch fallback (")
        and linear_attn_kind(rep) == "torch"
    )
    assert rep["causal_conv1d_fn"] == "torch fallback (inline torch code)"
    mod.chunk_gated_delta_rule = chunk_gated_delta_rule
    rep = linear_attn_report(mod)
    assert (
        rep["chunk_gated_delta_rule"]
        == "fla (fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule)"
    )
    assert linear_attn_kind(rep) == "fla"


_FAKE_FLA = {
    "fla/__init__.py": "",
    "fla/ops/__init__.py": "",
    "fla/ops/gated_delta_rule/__init__.py": textwrap.dedent("""
        def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=False, cu_seqlens=None):
            raise RuntimeError("fake fla kernel")

        def fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None,
                                             output_final_state=False, use_qk_l2norm_in_kernel=False,
                                             cu_seqlens=None):
            raise RuntimeError("fake fla kernel")
    """),
}


def _run_with_fake_fla(tmp_path, script: str) -> str:
    for rel, src in _FAKE_FLA.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(src)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_report_reads_fla_binding_and_refuses_a_late_switch(tmp_path):
    """With an importable `fla`, transformers binds it at import; the report follows the
    wrapper's closure to it, and selecting torch afterwards is refused (it cannot take effect)."""
    out = _run_with_fake_fla(
        tmp_path,
        """
        import json, torch
        import transformers.models.qwen3_5.modeling_qwen3_5 as m
        from dflash.target.linear_attn import linear_attn_report, linear_attn_kind, select_linear_attn_backend
        r = linear_attn_report()
        try:
            select_linear_attn_backend("torch", torch.device("cpu"))
            late = "accepted"
        except ValueError as e:
            late = str(e)
        print(json.dumps({"report": r, "kind": linear_attn_kind(r), "late": late}))
    """,
    )
    res = json.loads(out.strip().splitlines()[-1])
    assert (
        res["report"]["chunk_gated_delta_rule"]
        == "fla (fla.ops.gated_delta_rule.chunk_gated_delta_rule)"
    )
    assert res["report"]["recurrent_gated_delta_rule"].startswith("fla (")
    assert res["report"]["causal_conv1d_fn"].startswith(
        "torch fallback"
    )  # no causal_conv1d package
    assert res["kind"] == "fla"
    assert "imported with the fla" in res["late"]


def test_torch_selection_hides_an_already_imported_fla(tmp_path):
    out = _run_with_fake_fla(
        tmp_path,
        """
        import json, sys, torch
        import fla
        from dflash.target.linear_attn import linear_attn_report, linear_attn_kind
        from dflash.target import load_target, target_config_from_yaml
        t = load_target(target_config_from_yaml("tiny_qwen3_5", linear_attn_backend="torch"), num_aux=1)
        x = t.capture(torch.randint(0, 512, (1, 12)))  # the fake kernels would raise
        print(json.dumps({"kind": linear_attn_kind(linear_attn_report()), "backend": t.backend,
                          "fla_back": sys.modules.get("fla") is fla}))
    """,
    )
    res = json.loads(out.strip().splitlines()[-1])
    assert res == {"kind": "torch", "backend": "torch", "fla_back": True}


# ----------------------------------------------------------------------------- capture == HF
@pytest.mark.parametrize("name", ["tiny_qwen3_5", "tiny_llama"])
def test_capture_equals_hf_hidden_states(name):
    target = get_target(name, num_aux=3)
    ids = torch.randint(0, target.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    out = target.capture(ids, with_final_hidden=True)
    ref = target.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    H = target.hidden_size
    assert out.aux_NTF.shape == (2, 40, len(target.layer_ids) * H)
    for i, lid in enumerate(target.layer_ids):  # layer l = hidden_states[l + 1]
        torch.testing.assert_close(
            out.aux_NTF[..., i * H : (i + 1) * H], ref.hidden_states[lid + 1], rtol=0, atol=0
        )
        assert not torch.allclose(
            out.aux_NTF[..., i * H : (i + 1) * H], ref.hidden_states[lid], atol=1e-3
        )
    torch.testing.assert_close(out.final_hidden_NTH, ref.hidden_states[-1], rtol=0, atol=0)
    assert torch.equal(out.next_token_NT, ref.logits.argmax(-1))


def test_capture_labels_are_chunked_identically(tiny_qwen):
    ids = torch.randint(
        0, tiny_qwen.vocab_size, (1, 33), generator=torch.Generator().manual_seed(1)
    )
    assert torch.equal(
        tiny_qwen.capture(ids, label_chunk=7).next_token_NT, tiny_qwen.capture(ids).next_token_NT
    )


# ----------------------------------------------------------------------------- mask token
def test_mask_token_errors_name_the_fix():
    class NoMask:
        mask_token_id = None

    with pytest.raises(
        ValueError, match=r"no mask token; set target.mask_token_id.*add_special_tokens"
    ):
        resolve_mask_token_id(NoMask(), 100, None)
    with pytest.raises(ValueError, match="outside the target's embedding"):
        resolve_mask_token_id(NoMask(), 100, 100)
    assert resolve_mask_token_id(NoMask(), 100, 7) == 7
    assert resolve_mask_token_id(None, 100, None) == 99  # tokenizer-less random target


# ----------------------------------------------------------------------------- configs
def test_every_target_yaml_loads_without_hydra(monkeypatch):
    monkeypatch.setenv("DFLASH_ASSETS", "/assets")
    names = sorted(
        f[:-5] for f in os.listdir(os.path.join(ROOT, "conf", "target")) if f.endswith(".yaml")
    )
    for n in names:
        cfg = target_config_from_yaml(n)
        assert cfg.path is None or cfg.config is None, n  # a required path may be left unset
    smol = target_config_from_yaml("smollm2_135m")
    assert smol.path == "/assets/smollm2" and smol.mask_token_id == 16 and smol.chat_template
    assert target_config_from_yaml("qwen2_5_coder_0_5b").mask_token_id == 151662
    with pytest.raises(FileNotFoundError, match="choose one of"):
        load_conf("target", "no_such_target")
    from dflash.target.load import resolve_local_path

    with pytest.raises(ValueError, match="target.path is not set"):
        resolve_local_path(target_config_from_yaml("qwen3_6_27b"))
    with pytest.raises(FileNotFoundError, match="fetch_models.sh"):
        resolve_local_path(smol)


def test_env_resolution_without_omegaconf(monkeypatch):
    from dflash.target.load import _resolve_env

    monkeypatch.delenv("DFLASH_ASSETS", raising=False)
    monkeypatch.setenv("HOME", "/h")
    assert (
        _resolve_env("${oc.env:DFLASH_ASSETS,${oc.env:HOME}/.cache/dflash}/x")
        == "/h/.cache/dflash/x"
    )
    monkeypatch.setenv("DFLASH_ASSETS", "/a")
    assert _resolve_env({"p": ["${oc.env:DFLASH_ASSETS,${oc.env:HOME}/c}"]}) == {"p": ["/a"]}


# ----------------------------------------------------------------------------- parity
def _parity(tmp_path, *extra):
    from dflash.tools import parity

    out = tmp_path / "parity.json"
    rc = parity.main(
        [
            "--target",
            "tiny_qwen3_5",
            "--tokens",
            "48",
            "--layers",
            "1,3,5",
            "--out",
            str(out),
            *extra,
        ]
    )
    return rc, json.loads(out.read_text())


def test_parity_identical_settings_pass(tmp_path, capsys):
    rc, rep = _parity(tmp_path)
    assert rc == 0 and rep["pass"] and rep["failed_layers"] == []
    assert [r["layer"] for r in rep["layers"]] == [1, 3, 5]
    assert all(r["cos_mean"] > 1 - 1e-9 and r["abs_max"] == 0 for r in rep["layers"])
    assert rep["next_token_agreement"] == 1.0
    assert rep["a"]["backend"] == "torch" and not rep["separate_processes"]
    assert "PASS" in capsys.readouterr().out


def test_parity_names_a_perturbed_layer(tmp_path, capsys):
    rc, rep = _parity(tmp_path, "--perturb", "b:3:0.5")
    assert rc == 1 and not rep["pass"]
    assert rep["failed_layers"][0] == 3
    by = {r["layer"]: r for r in rep["layers"]}
    assert by[1]["pass"] and by[1]["abs_max"] == 0  # before the planted noise: identical
    assert not by[3]["pass"]
    assert "FAIL: layers [3" in capsys.readouterr().out


def test_parity_dtype_difference_is_small(tmp_path):
    rc, rep = _parity(tmp_path, "--b", "torch:bfloat16:cpu")
    assert rc == 0
    assert all(0.999 < r["cos_mean"] < 1.0 for r in rep["layers"])


def test_parity_usage_errors(tmp_path, capsys):
    from dflash.tools import parity

    assert parity.main(["--a", "torch:float32"]) == 2
    assert parity.main(["--a", "fla:float32:cpu", "--b", "fla:float32:cpu", "--tokens", "8"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.slow
def test_parity_in_two_subprocesses(tmp_path):
    """The path fla-vs-torch comparisons take (the backend is bound at import): each run in its
    own fresh process; here with torch on both sides, so results must be bit-identical."""
    out = tmp_path / "p.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash.tools.parity",
            "--target",
            "tiny_qwen3_5",
            "--tokens",
            "32",
            "--layers",
            "2,5",
            "--subprocess",
            "--perturb",
            "b:5:0.5",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["separate_processes"] and rep["failed_layers"] == [5]
    assert rep["layers"][0]["abs_max"] == 0.0
    assert "FAIL: layers [5]" in r.stdout
