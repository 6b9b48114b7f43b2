"""Platform registration and selection for the CPU platform and the CUDA skeleton."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pagedlm.backends.cpu import platform as cpu_platform
from pagedlm.backends.cpu.platform import CpuPlatform
from pagedlm.backends.cuda import plugin as cuda_plugin
from pagedlm.core.config import CacheConfig, VllmConfig
from pagedlm.core.platforms import available_platforms, resolve_platform
from pagedlm.core.plugins import get_plugins

GiB = 1 << 30
needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a usable GPU makes device='auto' pick CUDA")


@needs_no_gpu
def test_auto_resolves_to_cpu():
    platform = resolve_platform("auto")
    assert isinstance(platform, CpuPlatform)
    assert platform.device_name == "cpu" and platform.device_type == "cpu"
    assert resolve_platform("cpu") is platform  # instances are cached per class path
    assert isinstance(resolve_platform("cpu:0"), CpuPlatform)
    assert "cpu" in available_platforms()


def test_registrations():
    specs = {s.name: s for s in get_plugins().platforms()}
    assert specs["cpu"].class_path == "pagedlm.backends.cpu.platform:CpuPlatform"
    assert specs["cpu"].priority == 0 and specs["cpu"].is_available() is True
    assert specs["cuda"].class_path == "pagedlm.backends.cuda.platform:CudaPlatform"
    assert specs["cuda"].priority > specs["cpu"].priority
    backends = get_plugins().attention_backends()
    assert backends["cpu_paged"] == "pagedlm.backends.cpu.attention:CpuPagedAttentionBackend"


@needs_no_gpu
def test_cuda_reports_unavailable():
    assert cuda_plugin.cuda_is_available() is False
    assert "cuda" not in available_platforms()
    with pytest.raises(ValueError, match="not available"):
        resolve_platform("cuda")


def test_cuda_probe_never_raises(monkeypatch):
    def broken() -> bool:
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    assert cuda_plugin.cuda_is_available() is False


def test_cuda_plugin_and_probe_do_not_import_triton():
    code = (
        "import sys\n"
        "from pagedlm.backends.cuda import plugin\n"
        "plugin.cuda_is_available()\n"
        "import pagedlm.backends.cuda.platform\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_device_lists_allowed_names():
    with pytest.raises(ValueError, match="allowed: auto, ") as info:
        resolve_platform("tpu")
    message = str(info.value)
    assert "'tpu'" in message and "cpu" in message and "cuda" in message


def test_cpu_platform_config_hooks():
    platform = CpuPlatform()
    config = VllmConfig()
    assert platform.get_attn_backend_name(config) == "cpu_paged"
    assert platform.dist_backend == "gloo" and platform.default_dtype == torch.float32
    assert platform.supports_graphs
    assert platform.get_model_runner_cls(config) == "pagedlm.backends.cpu.model_runner:CpuModelRunner"
    platform.check_and_update_config(config)
    assert config.enforce_eager is False  # CPU graphs replay decode steps unless the user says eager
    assert platform.set_device(0) == torch.device("cpu")


@pytest.mark.parametrize("dtype", CpuPlatform.supported_dtypes)
def test_supported_dtypes_run_matmul(dtype):
    a = torch.randn(8, 16).to(dtype)
    assert (a @ a.T).dtype == dtype


def test_kv_cache_size_sources(monkeypatch):
    platform = CpuPlatform()
    cpu = torch.device("cpu")
    monkeypatch.setattr(cpu_platform, "available_host_memory_bytes", lambda: 100 * GiB)
    monkeypatch.delenv("PAGEDLM_CPU_KVCACHE_SPACE", raising=False)
    assert platform.kv_cache_memory_bytes(VllmConfig(), cpu) == 4 * GiB
    monkeypatch.setenv("PAGEDLM_CPU_KVCACHE_SPACE", "1.5")
    assert platform.kv_cache_memory_bytes(VllmConfig(), cpu) == int(1.5 * GiB)
    explicit = VllmConfig(cache_config=CacheConfig(kv_cache_memory_bytes=12345))
    assert platform.kv_cache_memory_bytes(explicit, cpu) == 12345  # the config beats the env
    # capped at half of what is available now
    monkeypatch.setattr(cpu_platform, "available_host_memory_bytes", lambda: 2 * GiB)
    monkeypatch.delenv("PAGEDLM_CPU_KVCACHE_SPACE")
    assert platform.kv_cache_memory_bytes(VllmConfig(), cpu) == 1 * GiB
    # unknown host memory: no cap
    monkeypatch.setattr(cpu_platform, "available_host_memory_bytes", lambda: None)
    assert platform.kv_cache_memory_bytes(VllmConfig(), cpu) == 4 * GiB
    with pytest.raises(ValueError, match="positive"):
        platform.kv_cache_memory_bytes(VllmConfig(cache_config=CacheConfig(kv_cache_memory_bytes=0)), cpu)


def test_available_host_memory_is_plausible():
    available = cpu_platform.available_host_memory_bytes()
    assert available is None or available > 0


def test_cuda_platform_description():
    from pagedlm.backends.cuda.platform import CudaPlatform

    platform = CudaPlatform()
    assert (platform.device_name, platform.device_type, platform.dist_backend) == ("cuda", "cuda", "nccl")
    assert platform.default_dtype == torch.bfloat16 and platform.supports_graphs
    assert platform.get_attn_backend_name(VllmConfig()) in ("triton", "flash_attn")
    assert platform.get_model_runner_cls(VllmConfig()) == "pagedlm.backends.cuda.model_runner:CudaModelRunner"
    explicit = VllmConfig(cache_config=CacheConfig(kv_cache_memory_bytes=4096))
    assert platform.kv_cache_memory_bytes(explicit, torch.device("cuda", 0)) == 4096


@pytest.mark.parametrize(("name", "gib", "usage", "expected"), [
    ("NVIDIA H200", 141, "llm", 16384),
    ("NVIDIA H200", 141, "server", None),
    ("NVIDIA A100-SXM4-80GB", 80, "llm", None),
    ("NVIDIA L4", 24, "llm", None),
])
def test_cuda_default_token_budget_follows_the_device(monkeypatch, name, gib, usage, expected):
    from types import SimpleNamespace

    from pagedlm.backends.cuda.platform import CudaPlatform

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(name=name, total_memory=gib * 2**30))
    assert CudaPlatform().default_max_num_batched_tokens(usage) == expected
    assert CudaPlatform().supports_async_scheduling and not CpuPlatform().supports_async_scheduling


def test_cpu_defaults_keep_the_engine_budget(tiny_llama):
    from pagedlm.core import LLM

    llm = LLM(model=tiny_llama, device="cpu")
    sc = llm.vllm_config.scheduler_config
    assert (sc.max_num_batched_tokens, sc.async_scheduling, llm.vllm_config.usage_context) == (8192, False, "llm")


def test_peak_memory_is_reset_before_the_profiling_run(tiny_llama, monkeypatch):
    """The KV budget counts this engine's peak, not one the process reached earlier (a model
    since freed): the platform's peak statistics are reset right before the profiling run."""
    from pagedlm.core import LLM
    from pagedlm.core.worker.model_runner import ModelRunner

    calls = []
    monkeypatch.setattr(CpuPlatform, "reset_peak_memory_stats", lambda self, device: calls.append("reset"))
    profile = ModelRunner.profile_run
    monkeypatch.setattr(ModelRunner, "profile_run", lambda self: (calls.append("profile"), profile(self))[1])
    LLM(model=tiny_llama, device="cpu", kv_cache_memory_bytes=32 << 20)
    assert calls == ["reset", "profile"]


def test_attention_backend_of_another_device_is_refused(tiny_llama, monkeypatch):
    from pagedlm.backends.cpu.attention import CpuPagedAttentionBackend
    from pagedlm.core import LLM

    monkeypatch.setattr(CpuPagedAttentionBackend, "supported_devices", ("cuda",))  # as if it were CUDA-only
    with pytest.raises(ValueError, match=r"attention_backend='cpu_paged' does not run on device='cpu' \(it "
                                         r"supports cuda\); backends for cpu: \["):
        LLM(model=tiny_llama, device="cpu", attention_backend="cpu_paged")


def test_cuda_probe_refuses_rocm_builds(monkeypatch):
    """A ROCm torch answers torch.cuda calls for AMD GPUs; those belong to another platform."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    assert cuda_plugin.cuda_is_available() is False
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert cuda_plugin.cuda_is_available() is True


def test_platform_services_are_declared_by_each_platform():
    from pagedlm.backends.cuda.platform import CudaPlatform

    cpu, cuda = CpuPlatform(), CudaPlatform()
    assert (cpu.ray_device_key, cuda.ray_device_key) == ("CPU", "GPU")
    assert (cpu.visible_devices_env_var, cuda.visible_devices_env_var) == (None, "CUDA_VISIBLE_DEVICES")
    assert cpu.is_pin_memory_available() is False and cuda.is_pin_memory_available() is True
    assert cpu.record_event() is None and cpu.allocated_memory_bytes(torch.device("cpu")) is None
    assert (cpu.profiler_activity, cuda.profiler_activity) == (None, "CUDA")


def test_core_asks_the_platform_instead_of_testing_device_types():
    """No core module tests a device-type string or calls torch.cuda: that is the platforms' job.
    Host memory is named through ``pagedlm.core.platforms.HOST``."""
    import re
    from pathlib import Path

    import pagedlm.core

    root = Path(pagedlm.core.__file__).parent
    # the interface's own defaults, and docstrings/comments that name devices as examples
    allowed = {"platforms/interface.py"}
    pattern = re.compile(r'"cuda"|"cpu"|torch\.cuda')
    offenders = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in allowed or rel.startswith("testing/"):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code) and not code.strip().startswith(("``", '"""')) and "``" not in code:
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert not offenders, "device-type tests in core:\n" + "\n".join(offenders)


def test_backends_declare_what_they_support():
    from pagedlm.backends.cpu.attention import CpuPagedAttentionBackend
    from pagedlm.backends.cuda.platform import CudaPlatform

    assert not CpuPagedAttentionBackend.supports_graphs and CpuPagedAttentionBackend.supported_devices == ("cpu",)

    class PagedBy256(CpuPagedAttentionBackend):  # a kernel's page size, as flash-attn's
        name = "paged_by_256"
        block_size_multiple = 256

    PagedBy256.validate(head_size=128, dtype=torch.float32, block_size=512)
    with pytest.raises(ValueError, match="'paged_by_256' needs block_size to be a multiple of 256; got block_size=16"):
        PagedBy256.validate(head_size=128, dtype=torch.float32, block_size=16)
    assert CudaPlatform().get_attn_backend_name(VllmConfig()) == "triton"  # flash_attn only on request


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kv_cache_is_zero_and_not_resident_until_used(dtype):
    shape = (2, 4096, 16, 2, 1024)  # 512 MiB in float32, 256 MiB in bfloat16
    before = _rss_bytes()
    cache = CpuPlatform().kv_cache_tensor(shape, dtype, torch.device("cpu"))
    grown = _rss_bytes() - before
    nbytes = cache.numel() * cache.element_size()
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert grown < nbytes // 8, f"allocating the cache made {grown} of {nbytes} bytes resident"
    cache[1, 100].fill_(3.0)  # writable, and a touched block stays put
    assert float(cache[1, 100].sum()) == 3.0 * 16 * 2 * 1024
    assert float(cache[0, :64].abs().sum()) == 0.0 and float(cache[1, 4000:].abs().sum()) == 0.0
