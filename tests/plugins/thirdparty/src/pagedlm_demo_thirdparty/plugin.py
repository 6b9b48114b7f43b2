"""A plugin written the way a third party would: a plain pluggy marker, no pagedlm internals."""

import pluggy

hookimpl = pluggy.HookimplMarker("pagedlm")


@hookimpl
def pagedlm_register_models(register):
    register("DemoTinyForCausalLM", "pagedlm_demo_thirdparty.model:DemoTinyForCausalLM")
