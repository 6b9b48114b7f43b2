from pagedlm.core.plugins import hookimpl


@hookimpl
def pagedlm_register_attention_backends(register):
    register("skewed_cpu", "pagedlm_demo_skewed_attention.attention:SkewedAttentionBackend")
