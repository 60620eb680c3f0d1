"""``--device`` and ``EngineConfig.device``: a device this torch cannot use is one clear line, before any model loads."""

import pytest
import torch
from click.testing import CliRunner

from nebula_engine.config import EngineConfig
from nebula_engine.devices import DeviceError, check_device
from nebula_engine.cli.generate import generate
from nebula_engine.cli.prefill import prefill
from nebula_engine.cli.serve import serve

CPU_ONLY_TORCH = not torch.backends.cuda.is_built()


def test_cpu_is_accepted():
    check_device("cpu")


@pytest.mark.parametrize("spec", ["gpu", "tpu", "cuda:x", "", "mps", "meta"])
def test_an_unknown_or_unsupported_device_is_named(spec):
    with pytest.raises(DeviceError, match=rf"^unknown device '{spec}': use cpu, cuda or cuda:N$"):
        check_device(spec)


@pytest.mark.skipif(not CPU_ONLY_TORCH, reason="this torch is a CUDA build")
@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_cuda_on_a_cpu_only_torch_says_so(spec):
    with pytest.raises(DeviceError, match=rf"device '{spec}' needs a CUDA build of torch, but torch .* is CPU-only"):
        check_device(spec)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_index_past_the_last_device_is_named():
    check_device("cuda")
    count = torch.cuda.device_count()
    with pytest.raises(DeviceError, match=rf"has {count} CUDA device\(s\)"):
        check_device(f"cuda:{count}")


def test_a_cuda_build_without_a_visible_gpu_says_so(monkeypatch):
    # no GPU here: torch's own CUDA queries stand in for a CUDA build on a machine without (enough) GPUs
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(DeviceError, match=r"built with CUDA but sees no GPU \(check the driver and CUDA_VISIBLE"):
        check_device("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device("cuda:1")
    with pytest.raises(DeviceError, match=r"^device 'cuda:2': this machine has 2 CUDA device\(s\), cuda:0 to cuda:1$"):
        check_device("cuda:2")


def test_the_engine_config_checks_its_device_before_resolving_the_model():
    with pytest.raises(DeviceError, match="unknown device 'gpu'"):
        EngineConfig("/nonexistent/model", device="gpu")


@pytest.mark.parametrize("command, args", [
    (generate, ["--model", "/nonexistent"]),
    (serve, ["--model", "/nonexistent"]),
    (prefill, ["--model", "/nonexistent", "--input", "/nonexistent.jsonl", "--disk-cache-path", "/tmp/x"]),
])
def test_a_command_refuses_a_bad_device_before_looking_at_the_model(command, args):
    result = CliRunner().invoke(command, [*args, "--device", "gpu"])
    assert result.exit_code == 2
    assert "Invalid value for '--device': unknown device 'gpu': use cpu, cuda or cuda:N" in result.output
    assert "/nonexistent" not in result.output


@pytest.mark.skipif(not CPU_ONLY_TORCH, reason="this torch is a CUDA build")
def test_serve_with_cuda_on_a_cpu_only_torch_is_one_line_not_a_traceback():
    result = CliRunner().invoke(serve, ["--model", "/nonexistent", "--device", "cuda"])
    assert result.exit_code == 2 and result.exception is not None and isinstance(result.exception, SystemExit)
    error_lines = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(error_lines) == 1 and "needs a CUDA build of torch" in error_lines[0]
    assert "Traceback" not in result.output and "AssertionError" not in result.output
