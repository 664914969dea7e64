"""fastbert.devices: a device name is checked against what torch sees; anything else is one ValueError."""

import pytest
import torch

from fastbert.devices import checked_device


def test_cpu_devices_and_names_that_are_not_devices():
    assert checked_device("cpu") == torch.device("cpu") and checked_device(torch.device("cpu:0")).type == "cpu"
    for name, message in [("cpu:5", "^device 'cpu:5' does not exist: there is one CPU device, 'cpu'$"),
                          ("gpu", "^unknown device 'gpu'$"), ("meta", r"^device 'meta' is not supported")]:
        with pytest.raises(ValueError, match=message):
            checked_device(name)


@pytest.mark.parametrize("count", [0, 1, 2])
def test_a_cuda_device_must_be_one_torch_sees(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    if count == 0:
        with pytest.raises(ValueError, match=r"^device 'cuda' is not present \(torch .* sees no CUDA GPU\)$"):
            checked_device("cuda")
        return
    assert checked_device("cuda") == torch.device("cuda")
    assert checked_device(f"cuda:{count - 1}") == torch.device("cuda", count - 1)
    with pytest.raises(ValueError, match=rf"^device 'cuda:{count}' is not present \(torch sees {count} CUDA GPU\(s\), "
                                         rf"cuda:0 to cuda:{count - 1}\)$"):
        checked_device(f"cuda:{count}")
