"""`--chat-template NAME`: each of llama.cpp's named templates we carry renders what llama.cpp's C++ formatter
(llama_chat_apply_template, src/llama-chat.cpp) writes. The expected strings are llama.cpp's: where its
tests/test-chat-template.cpp has a case for the format, that case's `expected_output` (its conversation below);
otherwise written out by hand from the format's branch in src/llama-chat.cpp."""

from __future__ import annotations

import pytest

from mtpserve.chat import ChatTemplate, ChatTemplateError, resolve_chat_template
from mtpserve.chat.builtin_templates import TEMPLATES

# test-chat-template.cpp's conversation, rendered with add_generation_prompt.
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "Who are you"},
    {"role": "assistant", "content": "   I am an assistant   "},
    {"role": "user", "content": "Another question"},
]
EOS_DS = "<｜end▁of▁sentence｜>"

EXPECTED = {
    # from test-chat-template.cpp (the case named in the comment)
    "chatml": "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nWho are you<|im_end|>\n<|im_start|>assistant\n   I am an assistant   <|im_end|>\n<|im_start|>user\nAnother question<|im_end|>\n<|im_start|>assistant\n",  # noqa: E501 - OpenHermes-2.5
    "llama2": "[INST] You are a helpful assistant\nHello [/INST]Hi there</s>[INST] Who are you [/INST]   I am an assistant   </s>[INST] Another question [/INST]",  # noqa: E501 - Mistral-7B-Instruct-v0.2
    "llama2-sys-bos": "[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST]Hi there</s><s>[INST] Who are you [/INST]   I am an assistant   </s><s>[INST] Another question [/INST]",  # noqa: E501 - FusionNet
    "llama2-sys-strip": "[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST]Hi there</s>[INST] Who are you [/INST]I am an assistant</s>[INST] Another question [/INST]",  # noqa: E501 - vigogne-2
    "mistral-v1": " [INST] You are a helpful assistant\n\nHello [/INST] Hi there</s> [INST] Who are you [/INST]    I am an assistant   </s> [INST] Another question [/INST]",  # noqa: E501
    "mistral-v3": "[INST] You are a helpful assistant\n\nHello[/INST] Hi there</s>[INST] Who are you[/INST] I am an assistant</s>[INST] Another question[/INST]",  # noqa: E501
    "mistral-v3-tekken": "[INST]You are a helpful assistant\n\nHello[/INST]Hi there</s>[INST]Who are you[/INST]   I am an assistant   </s>[INST]Another question[/INST]",  # noqa: E501
    "mistral-v7": "[SYSTEM_PROMPT] You are a helpful assistant[/SYSTEM_PROMPT][INST] Hello[/INST] Hi there</s>[INST] Who are you[/INST]    I am an assistant   </s>[INST] Another question[/INST]",  # noqa: E501
    "phi3": "<|system|>\nYou are a helpful assistant<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\nHi there<|end|>\n<|user|>\nWho are you<|end|>\n<|assistant|>\n   I am an assistant   <|end|>\n<|user|>\nAnother question<|end|>\n<|assistant|>\n",  # noqa: E501 - Phi-3-mini
    "phi4": "<|im_start|>system<|im_sep|>You are a helpful assistant<|im_end|><|im_start|>user<|im_sep|>Hello<|im_end|><|im_start|>assistant<|im_sep|>Hi there<|im_end|><|im_start|>user<|im_sep|>Who are you<|im_end|><|im_start|>assistant<|im_sep|>   I am an assistant   <|im_end|><|im_start|>user<|im_sep|>Another question<|im_end|><|im_start|>assistant<|im_sep|>",  # noqa: E501
    "gemma": "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n<start_of_turn>model\nHi there<end_of_turn>\n<start_of_turn>user\nWho are you<end_of_turn>\n<start_of_turn>model\nI am an assistant<end_of_turn>\n<start_of_turn>user\nAnother question<end_of_turn>\n<start_of_turn>model\n",  # noqa: E501 - gemma-7b-it
    "openchat": "You are a helpful assistant<|end_of_turn|>GPT4 Correct User: Hello<|end_of_turn|>GPT4 Correct Assistant: Hi there<|end_of_turn|>GPT4 Correct User: Who are you<|end_of_turn|>GPT4 Correct Assistant:    I am an assistant   <|end_of_turn|>GPT4 Correct User: Another question<|end_of_turn|>GPT4 Correct Assistant:",  # noqa: E501
    "vicuna": "You are a helpful assistant\n\nUSER: Hello\nASSISTANT: Hi there</s>\nUSER: Who are you\nASSISTANT:    I am an assistant   </s>\nUSER: Another question\nASSISTANT:",  # noqa: E501
    "vicuna-orca": "SYSTEM: You are a helpful assistant\nUSER: Hello\nASSISTANT: Hi there</s>\nUSER: Who are you\nASSISTANT:    I am an assistant   </s>\nUSER: Another question\nASSISTANT:",  # noqa: E501
    "deepseek": "You are a helpful assistant### Instruction:\nHello\n### Response:\nHi there\n<|EOT|>\n### Instruction:\nWho are you\n### Response:\n   I am an assistant   \n<|EOT|>\n### Instruction:\nAnother question\n### Response:\n",  # noqa: E501 - deepseek-coder-33b
    "deepseek2": f"You are a helpful assistant\n\nUser: Hello\n\nAssistant: Hi there{EOS_DS}User: Who are you\n\nAssistant:    I am an assistant   {EOS_DS}User: Another question\n\nAssistant:",  # noqa: E501
    "command-r": "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a helpful assistant<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hello<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Who are you<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>I am an assistant<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Another question<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",  # noqa: E501 - c4ai-command-r-plus
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWho are you<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nI am an assistant<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnother question<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",  # noqa: E501
    "chatglm3": "[gMASK]sop<|system|>\n You are a helpful assistant<|user|>\n Hello<|assistant|>\n Hi there<|user|>\n Who are you<|assistant|>\n    I am an assistant   <|user|>\n Another question<|assistant|>",  # noqa: E501
    "chatglm4": "[gMASK]<sop><|system|>\nYou are a helpful assistant<|user|>\nHello<|assistant|>\nHi there<|user|>\nWho are you<|assistant|>\n   I am an assistant   <|user|>\nAnother question<|assistant|>\n",  # noqa: E501
    "granite": "<|start_of_role|>system<|end_of_role|>You are a helpful assistant<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Hello<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>Hi there<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Who are you<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>   I am an assistant   <|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Another question<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>",  # noqa: E501 - granite-3.x
    # by hand from src/llama-chat.cpp (no test-chat-template.cpp case)
    "llama2-sys": "[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST]Hi there</s>[INST] Who are you [/INST]   I am an assistant   </s>[INST] Another question [/INST]",  # noqa: E501
    "mistral-v7-tekken": "[SYSTEM_PROMPT]You are a helpful assistant[/SYSTEM_PROMPT][INST]Hello[/INST]Hi there</s>[INST]Who are you[/INST]   I am an assistant   </s>[INST]Another question[/INST]",  # noqa: E501
    "falcon3": "<|system|>\nYou are a helpful assistant\n<|user|>\nHello\n<|assistant|>\nHi there\n<|user|>\nWho are you\n<|assistant|>\n   I am an assistant   \n<|user|>\nAnother question\n<|assistant|>\n",  # noqa: E501
    "zephyr": "<|system|>\nYou are a helpful assistant<|endoftext|>\n<|user|>\nHello<|endoftext|>\n<|assistant|>\nHi there<|endoftext|>\n<|user|>\nWho are you<|endoftext|>\n<|assistant|>\n   I am an assistant   <|endoftext|>\n<|user|>\nAnother question<|endoftext|>\n<|assistant|>\n",  # noqa: E501
    "deepseek3": f"You are a helpful assistant\n\n<｜User｜>Hello<｜Assistant｜>Hi there{EOS_DS}<｜User｜>Who are you<｜Assistant｜>   I am an assistant   {EOS_DS}<｜User｜>Another question<｜Assistant｜>",  # noqa: E501
    "llama4": "<|header_start|>system<|header_end|>\n\nYou are a helpful assistant<|eot|><|header_start|>user<|header_end|>\n\nHello<|eot|><|header_start|>assistant<|header_end|>\n\nHi there<|eot|><|header_start|>user<|header_end|>\n\nWho are you<|eot|><|header_start|>assistant<|header_end|>\n\nI am an assistant<|eot|><|header_start|>user<|header_end|>\n\nAnother question<|eot|><|header_start|>assistant<|header_end|>\n\n",  # noqa: E501
}
# What add_generation_prompt adds (llama2 and mistral add nothing: the prompt ends with [/INST]).
GENERATION_PROMPTS = {
    "chatml": "<|im_start|>assistant\n",
    "llama2": "",
    "llama2-sys": "",
    "llama2-sys-bos": "",
    "llama2-sys-strip": "",
    "mistral-v1": "",
    "mistral-v3": "",
    "mistral-v3-tekken": "",
    "mistral-v7": "",
    "mistral-v7-tekken": "",
    "phi3": "<|assistant|>\n",
    "phi4": "<|im_start|>assistant<|im_sep|>",
    "falcon3": "<|assistant|>\n",
    "zephyr": "<|assistant|>\n",
    "gemma": "<start_of_turn>model\n",
    "openchat": "GPT4 Correct Assistant:",
    "vicuna": "ASSISTANT:",
    "vicuna-orca": "ASSISTANT:",
    "deepseek": "### Response:\n",
    "deepseek2": "Assistant:",
    "deepseek3": "<｜Assistant｜>",
    "command-r": "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "llama4": "<|header_start|>assistant<|header_end|>\n\n",
    "chatglm3": "<|assistant|>",
    "chatglm4": "<|assistant|>\n",
    "granite": "<|start_of_role|>assistant<|end_of_role|>",
}


def test_every_name_is_tested():
    assert set(EXPECTED) == set(TEMPLATES) == set(GENERATION_PROMPTS)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_named_template_renders_llama_cpp_format(name):
    template = ChatTemplate(resolve_chat_template(name))
    out = template.apply(CONVERSATION)
    assert out.prompt == EXPECTED[name]
    assert out.generation_prompt == GENERATION_PROMPTS[name]
    without = template.apply(CONVERSATION, add_generation_prompt=False).prompt
    assert without + GENERATION_PROMPTS[name] == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_named_template_joins_text_parts_with_newlines(name):
    """llama.cpp's legacy path joins typed text parts with "\\n" before formatting."""
    template = ChatTemplate(TEMPLATES[name])
    parts = [{"type": "text", "text": "Another"}, {"type": "text", "text": "question"}]
    as_parts = [*CONVERSATION[:-1], {"role": "user", "content": parts}]
    as_text = [*CONVERSATION[:-1], {"role": "user", "content": "Another\nquestion"}]
    assert template.apply(as_parts).prompt == template.apply(as_text).prompt


def test_apply_template_command_r_as_llama_server_test():
    """tools/server/tests/unit/test_chat_completion.py::test_apply_chat_template."""
    messages = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there"}]
    assert ChatTemplate(resolve_chat_template("command-r")).apply(messages).prompt == (
        "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|>"
        "<|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    )


def test_trim_is_c_isspace():
    """llama.cpp trims with isspace: ASCII whitespace goes, a no-break space stays."""
    out = ChatTemplate(TEMPLATES["llama3"]).apply([{"role": "user", "content": "\t\v\f\r\n x\u00a0 \n"}])
    assert out.prompt.startswith("<|start_header_id|>user<|end_header_id|>\n\nx\u00a0<|eot_id|>")


def test_gemma_folds_every_system_message_into_the_next_user_turn():
    messages = [{"role": "system", "content": " A "}, {"role": "system", "content": "B"}, *CONVERSATION[1:2]]
    out = ChatTemplate(TEMPLATES["gemma"]).apply(messages, add_generation_prompt=False).prompt
    assert out == "<start_of_turn>user\nAB\n\nHello<end_of_turn>\n"


def test_unknown_name_lists_the_built_in_names():
    with pytest.raises(ChatTemplateError) as error:
        resolve_chat_template("llama-9")
    for name in TEMPLATES:
        assert name in str(error.value)
