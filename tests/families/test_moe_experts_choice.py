"""Which experts implementation an open adapter runs: grouped_mm only where torch's grouped GEMM has no host read.

torch's ``_grouped_mm`` on CUDA takes its CUTLASS kernel only for bf16 operands on compute capability 9.x /
10.x; elsewhere it copies the group offsets to the host and loops (a sync per grouped GEMM), so the model's
own implementation is kept. No GPU here: the device capability is mocked.
"""

from unittest import mock

import pytest
import torch

from dflash.target import families

CUDA = torch.device("cuda", 0)


def choice(current, capability, dtype, device=CUDA):
    with mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: capability), \
            mock.patch.object(torch.version, "hip", None):
        return families.choose_experts_implementation(current, device, dtype)


@pytest.mark.parametrize("capability,dtype,expected", [
    ((8, 0), torch.bfloat16, None),  # A100: the fallback loop, keep eager
    ((8, 6), torch.bfloat16, None),
    ((9, 0), torch.bfloat16, "grouped_mm"),  # H100 / H200: the CUTLASS kernel
    ((10, 0), torch.bfloat16, "grouped_mm"),  # B200
    ((12, 0), torch.bfloat16, None),  # consumer Blackwell: no kernel built for it
    ((9, 0), torch.float16, None),
    ((9, 0), torch.float32, None),
    ((8, 0), torch.float16, None),
])
def test_eager_experts_switch_only_on_the_fast_path(capability, dtype, expected):
    assert choice("eager", capability, dtype) == expected
    assert choice(None, capability, dtype) == expected


def test_other_implementations_are_kept():
    for current in ("grouped_mm", "batched_mm"):
        for capability in ((8, 0), (9, 0)):
            assert choice(current, capability, torch.bfloat16) is None
            assert choice(current, capability, torch.float16) is None


def test_rocm_keeps_the_model_s_own():
    with mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (9, 0)), \
            mock.patch.object(torch.version, "hip", "6.4"):
        assert families.choose_experts_implementation("eager", CUDA, torch.bfloat16) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu(dtype):
    """The CPU kernel (torch > 2.10) loops where the data is: no device to wait for, any dtype."""
    cpu = torch.device("cpu")
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    want = "grouped_mm" if (major, minor) > (2, 10) else None
    assert families.choose_experts_implementation("eager", cpu, dtype) == want
    with mock.patch.object(torch, "__version__", "2.10.0+cpu"):
        assert families.choose_experts_implementation("eager", cpu, dtype) is None


def test_unknown_dtype_keeps_the_model_s_own():
    assert choice("eager", (9, 0), None) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_resolve_passes_the_experts_weight_dtype(dtype):
    """The choice is made for the experts' own weights (what transformers casts the rows to) and device."""
    from tiny_models import tiny_family_target

    from dflash.target import TargetAdapter

    target = tiny_family_target("qwen3_moe", experts="eager", dtype=dtype)
    seen = []
    real = families.grouped_mm_fast_path

    def spy(device, dtype):
        seen.append((device, dtype))
        return real(device, dtype)

    with mock.patch.object(families, "grouped_mm_fast_path", spy):
        with TargetAdapter(target) as adapter:
            experts = adapter.spec.experts
    assert seen and all(d == (torch.device("cpu"), dtype) for d in seen)
    assert target.config._experts_implementation == "eager"
    assert experts == families.choose_experts_implementation("eager", torch.device("cpu"), dtype)
