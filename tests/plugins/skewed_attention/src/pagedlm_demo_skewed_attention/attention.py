"""The CPU reference backend with every attention score 3% too large: plausible output, wrong."""

from pagedlm.backends.cpu.attention import CpuPagedAttentionBackend, CpuPagedAttentionImpl

SKEW = 1.03


class SkewedAttentionImpl(CpuPagedAttentionImpl):
    def __init__(self, *, scale, **kwargs):
        super().__init__(scale=scale * SKEW, **kwargs)


class SkewedAttentionBackend(CpuPagedAttentionBackend):
    name = "skewed_cpu"
    supported_devices = ("cpu",)

    @staticmethod
    def get_impl_cls():
        return SkewedAttentionImpl
