"""sft_tools.py: the demonstrations are the conversations grpo_tools.py's rollout would build, id for id, with the
environment's ids out of the loss; the warm-up runs and its model starts grpo_tools.py in the chat format."""

import pytest
import torch
from test_smoke import rows, run_here
from test_tools import QWEN_TEMPLATE, byte_tokenizer, family_tokenizer

import sft_tools
import tools


def test_a_demonstration_is_the_rollouts_conversation_with_the_tools_answer_out_of_the_loss():
    """A demonstration that calls: the call turn as the format writes it and the template's end-of-turn token, the
    calculator's real answer in the template's tool message (not a target), the last turn and its end-of-turn token
    (targets). Decoded, it is what the template renders for that conversation; one that does not call is the last turn
    alone."""
    tokenizer, eos = family_tokenizer("qwen")
    chat = tools.ChatFormat(tokenizer, eos)
    ids, is_target = sft_tools.demonstration(tokenizer, chat, 347, 86, call=True)
    text = lambda keep: tokenizer.decode([i for i, t in zip(ids, is_target) if t == keep])
    assert text(True) == "<calc>347 * 86</calc><|im_end|>347 * 86 = 29842<|im_end|>"
    assert text(False) == "\n<|im_start|>user\n<tool_response>\n29842\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    messages = [{"role": "user", "content": "What is 347 * 86?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    messages += [
        {"role": "assistant", "content": "<calc>347 * 86</calc>"},
        {"role": "tool", "content": "29842"},
        {"role": "assistant", "content": "347 * 86 = 29842"},
    ]
    assert prompt + tokenizer.decode(ids) + "\n" == tokenizer.apply_chat_template(messages, tokenize=False)
    ids, is_target = sft_tools.demonstration(tokenizer, chat, 347, 86, call=False)
    assert tokenizer.decode(ids) == "347 * 86 = 29842<|im_end|>" and all(is_target)


@pytest.mark.parametrize("family", ["qwen", "llama", "mistral"])
def test_with_a_template_that_knows_tools_the_demonstration_calls_in_its_format(family):
    tokenizer, eos = family_tokenizer(family)
    chat = tools.ChatFormat(tokenizer, eos, [tools.calculator])
    ids, is_target = sft_tools.demonstration(tokenizer, chat, 12, 34, call=True)
    call_turn = tokenizer.decode(ids[: is_target.index(False) - len(chat.end_of_turn)])
    assert chat.find_call(call_turn) == ("calculator", {"expression": "12 * 34"})


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    """A random tiny Llama with a byte-level tokenizer and a ChatML template: a chat model that tests can run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = byte_tokenizer(QWEN_TEMPLATE, ["<|im_end|>", "<|endoftext|>", "<|im_start|>"], None)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    path = str(tmp_path_factory.mktemp("tiny_chat") / "model")
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_sft_tools_then_grpo_tools_in_the_chat_format(tiny_chat_model, tmp_path, monkeypatch):
    """The pipeline of docs/tools.md on a tiny chat model: the warm-up logs its loss (finite, falling over 8 steps at a
    high learning rate on the same kind of conversation) and saves a model that grpo_tools.py starts from."""
    warm = tmp_path / "warm"
    flags = ["--model-name-or-path", tiny_chat_model, "--num-steps", "8", "--batch-size", "4", "--learning-rate", "1e-2"]
    run_here(monkeypatch, "sft_tools.py", *flags, "--device", "cpu", "--output-dir", str(warm))
    losses = [r["sft/loss"] for r in rows(warm)]
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    flags = ["--model-name-or-path", str(warm / "model"), "--task", "products", "--tool-format", "chat", "--num-eval", "4"]
    flags += ["--total-steps", "1", "--num-prompts", "2", "--group-size", "2", "--max-new-tokens", "96"]
    run_here(monkeypatch, "grpo_tools.py", *flags, "--device", "cpu", "--output-dir", str(tmp_path / "rl"))
    assert [r["step"] for r in rows(tmp_path / "rl")] == [0, 1]


def test_bad_flags_are_refused_in_one_line(tiny_chat_model):
    with pytest.raises(SystemExit, match=r"--tool-share 1.5: must be in \[0, 1\]"):
        sft_tools.check_args(sft_tools.Args(model_name_or_path=tiny_chat_model, tool_share=1.5))
    with pytest.raises(SystemExit, match="--chat-template none: allowed values are auto and on"):
        sft_tools.check_args(sft_tools.Args(model_name_or_path=tiny_chat_model, chat_template="none"))
    with pytest.raises(SystemExit, match="--num-steps 0: must be at least 1"):
        sft_tools.check_args(sft_tools.Args(model_name_or_path=tiny_chat_model, num_steps=0))
