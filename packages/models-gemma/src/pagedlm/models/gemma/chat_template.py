"""Gemma's chat format, the family's default template for checkpoints that carry none.

Gemma marks each turn ``<start_of_turn>{role}\\n{text}<end_of_turn>\\n`` with roles ``user`` and
``model``, after one ``<bos>``; it has no system role, so a system message is prepended to the
first user turn, separated by a blank line. A generation prompt opens a ``model`` turn. Roles must
alternate user, model, user, ... (as Google's own template requires).

The base Gemma 3 270M GGUF on PyPI (the default model) has no template in its metadata, so
``LLM().chat(...)`` and chat completions on ``pagedlm serve`` use this one.
"""

GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set turns = messages -%}"
    "{%- set preamble = '' -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set preamble = messages[0]['content'] ~ '\\n\\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set expected = 'user' if loop.index0 % 2 == 0 else 'assistant' -%}"
    "{%- if message['role'] != expected -%}"
    "{{ raise_exception('Gemma chats alternate user and assistant turns (after an optional system "
    "message); message ' ~ loop.index0 ~ ' has role ' ~ message['role']) }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' ~ ('model' if message['role'] == 'assistant' else 'user') ~ '\\n' }}"
    "{{- (preamble if loop.first else '') ~ (message['content'] | trim) ~ '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
