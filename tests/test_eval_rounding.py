"""The in-loop eval sees the exported (bf16-rounded) weights and leaves the training weights
bit-identical afterwards."""

import torch
from conftest import make_drafter

from dflash.eval.offline import rounded_to


def test_rounded_to_evaluates_export_weights_and_restores_master(tiny_qwen):
    d = make_drafter(tiny_qwen)
    with torch.no_grad():
        d.fc.weight.add_(1e-4)  # not representable in bf16
    master = {k: v.clone() for k, v in d.state_dict().items()}
    with rounded_to(d, torch.bfloat16):
        for k, v in d.state_dict().items():
            assert v.dtype == torch.float32
            assert torch.equal(v, master[k].to(torch.bfloat16).float()), k
        assert not torch.equal(d.fc.weight, master["fc.weight"])
    for k, v in d.state_dict().items():
        assert torch.equal(v, master[k]), k
