"""The built-in byte-level tokenizer of the tiny targets: every data source runs offline on them."""

import json

import pytest

from dflash.target.tokenizer import byte_tokenizer, make_tokenizer


def test_byte_tokenizer_round_trips_utf8_and_reserves_the_last_id_for_the_mask():
    tok = byte_tokenizer(512)
    text = 'def f(x):\n    """Héllo, wörld ✓"""\n\treturn x\n'
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # one token per byte, id = byte value
    assert tok.decode(ids) == text
    assert len(tok) == 512 and tok.mask_token_id == 511 and tok.mask_token == "<|mask|>"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.convert_ids_to_tokens(256) == "<|endoftext|>"
    # the mask token never comes out of text (it is special, not byte-spelled)
    assert tok.mask_token_id not in tok("<|mask|> text")["input_ids"][6:]


def test_byte_tokenizer_chat_template_with_thinking_switch():
    tok = byte_tokenizer(300)
    msgs = [{"role": "user", "content": "hi"}]
    kw = dict(add_generation_prompt=True, tokenize=False)
    assert (
        tok.apply_chat_template(msgs, enable_thinking=True, **kw)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(msgs, enable_thinking=False, **kw).endswith(
        "assistant\n<think>\n\n</think>\n\n"
    )


def test_tokenizer_setting_errors_name_the_key():
    with pytest.raises(ValueError, match=r"target.tokenizer=bytes needs target.config.vocab_size"):
        byte_tokenizer(100)
    with pytest.raises(ValueError, match=r"target.tokenizer='gpt2' is not allowed"):
        make_tokenizer("gpt2", 512)
    assert make_tokenizer(None, 512) is None


def _cfg(tmp_path, target, source, extra=()):
    from conftest import CONF
    from hydra import compose, initialize_config_dir

    from dflash.run.cli import setup, typed

    setup()
    over = [
        f"target={target}",
        f"data={source}",
        "train.steps=2",
        "train.save_every=2",
        "train.eval_every=2",
        "train.micro_batch_size=2",
        "train.max_anchors=4",
        "data.num_samples=6",
        "data.response_len=8",
        "data.regen_batch_size=8",
        "eval.num_prompts=2",
        "eval.completion_len=8",
        "logger=none",
        f"out_root={tmp_path}",
        *extra,
    ]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return typed(compose("config", overrides=over))


@pytest.mark.parametrize(
    "target,source",
    [("tiny_qwen3_5", "jsonl"), ("tiny_llama", "stdlib"), ("tiny_qwen3_5", "selfgen")],
)
def test_every_data_source_trains_offline_on_a_tiny_target(tmp_path, target, source):
    from dflash.data.dataset import load_samples
    from dflash.train.colocated import run_colocated

    extra = []
    if source == "jsonl":
        f = tmp_path / "prompts.jsonl"
        rows = [{"prompt": f"Write a haiku about the number {i}."} for i in range(6)]
        rows += [{"messages": [{"role": "user", "content": f"Count to {i}."}]} for i in range(4)]
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
        extra = [f"data.paths=[{f}]"]
    if source == "stdlib":
        extra = ["data.max_length=2048"]  # byte tokens: stdlib stubs are a few hundred long
    cfg = _cfg(tmp_path, target, source, extra)
    run_dir = tmp_path / "run"
    out = run_colocated(cfg, str(run_dir))
    assert out["checkpoint"].endswith("step_00000002") and "eval/tau" in out
    (cache,) = (run_dir / "data").glob("train-*.pt")
    samples = load_samples(str(cache))
    assert len(samples) == 6
    if source != "selfgen":  # text sources: prompts are chat-templated text in byte tokens
        head = byte_tokenizer(512).decode(samples[0].input_ids[~samples[0].loss_mask].tolist())
        assert head.startswith("<|im_start|>user\n")
        assert head.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # no thinking
