"""Fixtures shared by several test files, and the threads of the suite's processes."""

import os

import pytest
import torch

import sft
import tasks


def pytest_configure(config):
    """pyproject.toml runs the suite in two processes (pytest-xdist's `-n 2`, a whole file to one process). Each of them,
    and every program a test starts, computes with one thread: two processes of two threads each on two cores slow each
    other down many times over. Run alone (`-n 0`), the suite keeps torch's default."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny model after a few warm-up steps (the real warm-up runs far longer; this only has to run)."""
    path = str(tmp_path_factory.mktemp("warm") / "model")
    sft.warm_up(sft.Args(output_dir=path, max_steps=30, check_every=30, target_accuracy=2.0, num_check=100, device="cpu"))
    return path


@pytest.fixture(scope="session")
def teacher_dir(model_dir, tmp_path_factory):
    """A teacher for opd.py that disagrees with the student (model_dir) from the first step: the same model with every
    weight moved by seeded noise, the same tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tmp_path_factory.mktemp("teacher") / "model")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory):
    """A tiny model after a short warm-up on the multiplication task (grpo_tools.py's): it has the tool task's vocabulary
    and has begun to write calls."""
    path = str(tmp_path_factory.mktemp("warm_tools") / "model")
    steps = 60  # of 32 problems: sampled at temperature 1, it then calls the tool about once in ten conversations
    # (max_new_tokens=1: the warm-up's closing evaluation, which nothing here reads, costs one token per problem)
    args = dict(max_steps=steps, check_every=steps, target_accuracy=2.0, num_check=100, batch_size=32, max_new_tokens=1)
    sft.warm_up(sft.Args(task="multiplication", output_dir=path, **args))
    return path


@pytest.fixture(scope="session")
def tool_data(tmp_path_factory):
    """16 multiplication problems as a --dataset file (--task multiplication reads them), so that a test's evaluation
    runs on a few held-out conversations instead of the task's 500."""
    import json

    path = tmp_path_factory.mktemp("tool_data") / "products.jsonl"
    path.write_text(
        "\n".join(json.dumps({"prompt": f"{a}*{a % 90 + 10}=", "answer": a * (a % 90 + 10)}) for a in range(101, 117))
    )
    return str(path)


@pytest.fixture(scope="session")
def tool_run_flags(tool_model_dir, tool_data):
    """grpo_tools.py's flags for a test run: the multiplication model on the 16 problems of tool_data, 4 held out."""
    return ["--model-name-or-path", tool_model_dir, "--task", "multiplication", "--dataset", tool_data, "--num-eval", "4"]


CHATML = (  # Qwen2.5's ChatML, without its tool calls
    r"{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    r"{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    """The folder of a tiny Qwen2ForCausalLM whose generation config ends a response at <|im_end|> (end of turn) or at
    <|endoftext|> (end of text, also the pad token), as Qwen2.5-Instruct's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = str(tmp_path_factory.mktemp("chat") / "model")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [f"What is {a} plus {b}? The answer is {a + b}." for a in range(40) for b in range(12)]
    bpe.train_from_iterator(corpus + [text for text in tasks.INSTRUCTIONS.values()] * 5, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    end_of_turn, end_of_text = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=[end_of_turn, end_of_text],
        pad_token_id=end_of_text,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=[end_of_turn, end_of_text], pad_token_id=end_of_text)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
