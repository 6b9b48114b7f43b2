from pagedlm.models.llama import LlamaForCausalLM


class DemoTinyForCausalLM(LlamaForCausalLM):
    """Same weights layout as Llama, served under a new architecture name."""
