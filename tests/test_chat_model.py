"""A real model's path, offline: a tiny Qwen2 (random weights) with a byte-level BPE tokenizer trained here, a ChatML
chat template and two EOS ids, saved to a folder and loaded by path, like Qwen2.5-Instruct; a user's data file."""

import json
import os
import shutil

import pytest
import torch
from test_smoke import SMALL, coin_flip_rewards, rows, run_here

import common
import sft
import tasks
from plumbing import models


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """Prompts and answers scored by gsm8k's verifier (the last number of the completion)."""
    path = tmp_path_factory.mktemp("data") / "questions.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"What is {a} plus 3?", "answer": a + 3}) for a in range(24)))
    return str(path)


def test_prompts_are_rendered_with_the_chat_template(chat_model_dir, data_file):
    model, tokenizer = models.load_model_and_tokenizer(chat_model_dir, "", torch.device("cpu"))
    task = tasks.make_task("gsm8k", data_file, num_eval=4)
    assert len(task.eval) == 4 and len(task.train) == 20 and not set(task.eval["prompt"]) & set(task.train["prompt"])
    assert task.train["answer"][0].isdigit()  # integers in the file are read as answer text
    raw = task.train[0]["prompt"]
    rendered = tasks.apply_chat_template(task, tokenizer, "auto")
    expected = (
        f"<|im_start|>system\n{tasks.INSTRUCTIONS['gsm8k']}<|im_end|>\n<|im_start|>user\n{raw}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert rendered.train[0]["prompt"] == expected and rendered.eval[0]["prompt"].endswith("<|im_start|>assistant\n")
    ids, _ = common.tokenize_prompts(tokenizer, [expected], torch.device("cpu"))
    assert ids[0, 0].item() == tokenizer.convert_tokens_to_ids("<|im_start|>")  # the markers are single special tokens
    assert tasks.apply_chat_template(task, tokenizer, "none").train[0]["prompt"] == raw
    assert common.eos_token_ids(model, tokenizer) == sorted(tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))


def test_generation_stops_at_either_eos(chat_model_dir):
    """Greedy decoding steered to end row 0 with <|im_end|> at its second token and row 1 with <|endoftext|> at its
    third: each row's mask runs through its own EOS, neither is truncated, and row 2 (no EOS) is."""
    model, tokenizer = models.load_model_and_tokenizer(chat_model_dir, "", torch.device("cpu"))
    end_of_turn, end_of_text = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    word = tokenizer("What", add_special_tokens=False).input_ids[0]
    steps = []

    def steer(module, args, kwargs, out):
        logits = torch.full_like(out.logits, -10.0)
        logits[..., word] = 10.0
        step = len(steps)
        if step == 1:
            logits[0, -1, end_of_turn] = 20.0
        if step == 2:
            logits[1, -1, end_of_text] = 20.0
        steps.append(step)
        out.logits = logits
        return out

    model.register_forward_hook(steer, with_kwargs=True)
    prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, ["What is 1 plus 3?", "What", "What is"], torch.device("cpu"))
    ids, mask, truncated = common.generate(model, tokenizer, prompt_ids, prompt_mask, 4, temperature=0.0)
    assert ids[0, 1].item() == end_of_turn and ids[1, 2].item() == end_of_text
    assert mask.sum(dim=1).tolist() == [2, 3, 4] and truncated.tolist() == [False, False, True]


@pytest.mark.parametrize(
    "script",
    ["grpo.py", "rloo.py", "dr_grpo.py", "dapo.py", "gspo.py", "ppo.py", "dpo.py", "reward_model.py"]
    + ["ipo.py", "simpo.py", "orpo.py", "kto.py"],
)
def test_every_script_trains_the_chat_model_on_a_data_file(chat_model_dir, data_file, tmp_path, monkeypatch, script):
    """Two steps of each script on the chat model, loaded by path, with the user's data file (DPO and the reward model:
    pairs of the user's plain prompts, which the script renders with the chat template as the policy reads them,
    offline): the prompts it was fed carry the chat template."""
    flags = ["--model-name-or-path", chat_model_dir, "--output-dir", str(tmp_path), "--max-new-tokens", "6"]
    if script in ("dpo.py", "reward_model.py", "ipo.py", "simpo.py", "orpo.py", "kto.py"):  # the file's prompts, offline
        plain = tasks.make_task("gsm8k", data_file, num_eval=4).train
        pairs = [{**row, "chosen": row["answer"], "rejected": "0"} for row in plain.to_list()]
        pairs = [{**p, "completion": p["answer"] if i % 2 else "0", "label": i % 2} for i, p in enumerate(pairs)]  # kto.py
        (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(pair) for pair in pairs))
        flags += ["--dataset", str(tmp_path / "pairs.jsonl"), "--task", "gsm8k", "--batch-size", "4"]
        flags += ["--num-eval", "4", "--total-steps", "2", "--eval-every", "2", "--device", "cpu"]
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing of the task's data is read
    else:
        coin_flip_rewards(monkeypatch, p=0.5)  # DAPO needs groups of mixed scores; the others do not mind
        flags += [*SMALL, "--task", "gsm8k", "--dataset", data_file, "--num-eval", "4", "--eval-every", "2"]
    run_here(monkeypatch, script, *flags)
    logged = rows(tmp_path)
    evaluated = "eval/pairwise_accuracy" if script == "reward_model.py" else "eval/accuracy"
    assert [r["step"] for r in logged] == [0, 1, 2] and evaluated in logged[-1]
    assert os.path.isfile(tmp_path / "model" / "tokenizer_config.json")
    if script != "reward_model.py":  # (the reward model answers nothing: it scores pairs)
        with open(tmp_path / "samples.jsonl") as f:
            samples = [json.loads(line) for line in f]
        assert samples and all(s["prompt"].startswith("<|im_start|>system\n") for s in samples)


def test_bad_model_folders_and_data_are_refused_in_one_line(chat_model_dir, data_file, tmp_path):
    weights_only = tmp_path / "weights_only"
    weights_only.mkdir()
    for name in os.listdir(chat_model_dir):
        if not name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(os.path.join(chat_model_dir, name), weights_only / name)
    with pytest.raises(SystemExit, match="no tokenizer in this folder") as info:
        models.load_model_and_tokenizer(str(weights_only), "", torch.device("cpu"))
    assert "\n" not in str(info.value.code)
    no_answer = tmp_path / "no_answer.jsonl"
    no_answer.write_text(json.dumps({"prompt": "What is 1 plus 3?", "solution": "4"}))
    with pytest.raises(
        SystemExit, match=r"--dataset .*no_answer.jsonl': missing column\(s\) answer \(it has prompt, solution\)"
    ):
        tasks.make_task("gsm8k", str(no_answer))
    text = tmp_path / "questions.txt"
    text.write_text("What is 1 plus 3?")
    with pytest.raises(SystemExit, match="--dataset .*: cannot read .txt files"):
        tasks.make_task("gsm8k", str(text))
    import grpo

    for model, mode in (("builtin", "on"), (chat_model_dir, "sometimes")):
        with pytest.raises(SystemExit, match="--chat-template"):
            grpo.check_args(grpo.Args(model_name_or_path=model, chat_template=mode, output_dir=str(tmp_path / "out")))
    grpo.check_args(grpo.Args(model_name_or_path=chat_model_dir, chat_template="on", output_dir=str(tmp_path / "out")))


def test_plain_prompts_get_the_bos_the_tokenizer_adds():
    """A base model's tokenizer that starts every encoding with BOS (as Llama's does) was trained with it: a plain prompt
    (no chat template, or --chat-template none) is fed behind it. The built-in tokenizer has no BOS: its prompts stay
    as they are."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", *"0123456789+="])}
    raw = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    task = tasks.make_task("addition")
    plain = tasks.apply_chat_template(task, tokenizer, "auto")
    assert plain.eval[0]["prompt"] == "<s>" + task.eval[0]["prompt"] and not plain.chat
    ids, _ = common.tokenize_prompts(tokenizer, [plain.eval[0]["prompt"]], torch.device("cpu"))
    assert ids[0, 0].item() == 1 and ids[0, 1].item() == vocab[task.eval[0]["prompt"][0]]
    assert tasks.apply_chat_template(task, sft.build_tokenizer(), "auto").eval[0]["prompt"] == task.eval[0]["prompt"]


def test_preference_pairs_keep_the_end_token_each_answer_was_sampled_with(chat_model_dir):
    """The chat model's answers are steered to "What" (the even rows of a group) or "WhatWhat" (the odd ones), each ended
    with <|endoftext|>, not with the tokenizer's EOS <|im_end|>: the pair of "What" (counted correct) against "WhatWhat"
    trains the end token the policy used."""
    from types import SimpleNamespace

    import preference_pairs

    model, tokenizer = models.load_model_and_tokenizer(chat_model_dir, "", torch.device("cpu"))
    end_of_text, word = (
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        tokenizer("What", add_special_tokens=False).input_ids[0],
    )
    steps = []

    def steer(module, args, kwargs, out):
        step, rows = len(steps), torch.arange(out.logits.shape[0])
        logits = torch.full_like(out.logits, -30.0)
        ends = (rows % 2 == 0) if step == 1 else (rows % 2 == 1) if step == 2 else torch.zeros_like(rows, dtype=torch.bool)
        logits[:, -1, word] = 30.0
        logits[ends, -1, word], logits[ends, -1, end_of_text] = -30.0, 30.0
        steps.append(step)
        out.logits = logits
        return out

    model.register_forward_hook(steer, with_kwargs=True)
    task = tasks.make_task("addition")
    task.verify = lambda texts, answers: torch.tensor([float(t.strip() == "What") for t in texts])
    args = SimpleNamespace(num_pair_prompts=1, group_size=4, max_new_tokens=4)
    pairs, skipped = preference_pairs.sample_verifier_pairs(model, tokenizer, task, args, torch.device("cpu"))
    assert skipped == 0 and list(pairs["chosen"]) == ["What"] and list(pairs["rejected"]) == ["WhatWhat"]
    data = preference_pairs.tokenize_pairs(tokenizer, pairs[:], torch.device("cpu"))
    for key in ("chosen", "rejected"):
        last = data[f"{key}_mask"].sum(dim=1) - 1
        assert data[f"{key}_ids"][0, last[0]].item() == end_of_text, key


def test_a_users_prompts_rendered_by_their_author_are_refused_for_the_rl_scripts_too(chat_model_dir, tmp_path, monkeypatch):
    """A --dataset whose prompts already hold the chat template's markers would be rendered twice: refused in one line
    naming --chat-template none, which uses them as given; grpo.py refuses them before any weights load."""
    _, tokenizer = models.load_model_and_tokenizer(chat_model_dir, "", torch.device("cpu"))
    rendered = tmp_path / "rendered.jsonl"
    rows_ = [
        {"prompt": f"<|im_start|>user\nWhat is {a} plus 3?<|im_end|>\n<|im_start|>assistant\n", "answer": a + 3}
        for a in range(8)
    ]
    rendered.write_text("\n".join(json.dumps(row) for row in rows_))
    task = tasks.make_task("gsm8k", str(rendered), num_eval=2)
    for mode in ("auto", "on"):
        with pytest.raises(SystemExit) as info:
            tasks.apply_chat_template(task, tokenizer, mode)
        line = str(info.value.code)
        assert line.startswith("--dataset: a prompt already holds the tokenizer's special tokens") and "\n" not in line
        assert "--chat-template none" in line
    as_given = tasks.apply_chat_template(task, tokenizer, "none")
    assert as_given.train["prompt"] == task.train["prompt"] and as_given.eval["prompt"] == task.eval["prompt"]
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: pytest.fail("loaded a model before refusing the prompts"))
    with pytest.raises(SystemExit, match="^--dataset: a prompt already holds"):  # grpo.py: before any weights load
        flags = ["--model-name-or-path", chat_model_dir, "--task", "gsm8k", "--dataset", str(rendered), "--num-eval", "2"]
        run_here(monkeypatch, "grpo.py", *flags, "--num-prompts", "2", "--output-dir", str(tmp_path / "run"))


def test_the_instruction_flag_is_the_system_message(chat_model_dir, data_file):
    """--instruction replaces the task's answer format as the system message, for a user's prompts too."""
    _, tokenizer = models.load_model_and_tokenizer(chat_model_dir, "", torch.device("cpu"))
    task = tasks.make_task("gsm8k", data_file, num_eval=4)
    rendered = tasks.apply_chat_template(task, tokenizer, "auto", "Reply with the number only.")
    assert rendered.train[0]["prompt"].startswith("<|im_start|>system\nReply with the number only.<|im_end|>\n")


@pytest.mark.parametrize("script", ["dpo.py", "reward_model.py"])
def test_a_users_preference_prompts_are_rendered_like_the_rl_scripts_prompts(chat_model_dir, tmp_path, monkeypatch, script):
    """dpo.py and reward_model.py with --dataset on a chat model: the pairs' prompts are rendered with the chat template
    as grpo.py renders a user's prompts (the --task's answer format as the system message, --chat-template none leaves
    them as given); a prompt already rendered by its author is refused in one line instead of being rendered twice."""
    import preference_pairs

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "\n".join(json.dumps({"prompt": f"What is {a} plus 3?", "chosen": "7", "rejected": "9"}) for a in range(8))
    )
    seen = []
    tokenize = preference_pairs.tokenize_pairs
    monkeypatch.setattr(
        preference_pairs, "tokenize_pairs", lambda tok, p, dev: seen.extend(p["prompt"]) or tokenize(tok, p, dev)
    )
    flags = ["--model-name-or-path", chat_model_dir, "--dataset", str(pairs), "--task", "gsm8k", "--num-eval", "2"]
    flags += ["--batch-size", "2", "--total-steps", "1", "--device", "cpu", "--max-new-tokens", "4"]
    for template in ("auto", "none"):
        seen.clear()
        run_here(monkeypatch, script, *flags, "--chat-template", template, "--output-dir", str(tmp_path / template))
        question = next(p for p in seen if "What is 0 plus 3?" in p)
        system = f"<|im_start|>system\n{tasks.INSTRUCTIONS['gsm8k']}<|im_end|>\n"
        rendered = f"{system}<|im_start|>user\nWhat is 0 plus 3?<|im_end|>\n<|im_start|>assistant\n"
        assert question == (rendered if template == "auto" else "What is 0 plus 3?"), template
    pairs.write_text(
        "\n".join(
            json.dumps({"prompt": f"<|im_start|>user\n{a}+3<|im_end|>", "chosen": "7", "rejected": "9"}) for a in range(8)
        )
    )
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: pytest.fail("loaded a model before refusing the prompts"))
    with pytest.raises(SystemExit) as exit_info:
        run_here(monkeypatch, script, *flags, "--output-dir", str(tmp_path / "twice"))
    line = str(exit_info.value.code)
    assert line.startswith("--dataset: a prompt already holds the tokenizer's special tokens") and "\n" not in line


def test_the_real_model_benchmark_writes_plain_prompts_that_dpo_renders(chat_model_dir, tmp_path):
    """benchmark_real_model.write_pairs writes pairs as a user writes them, plain questions: dpo.py (and reward_model.py)
    accept them and render each with the chat template and the sums task's instruction. Pairs rendered by the writer
    would be refused (a prompt holding special tokens) and the benchmark would stop there."""
    import transformers

    import dpo
    import preference_pairs
    from benchmarks import benchmark_real_model

    path = str(tmp_path / "pairs.jsonl")
    benchmark_real_model.write_pairs(path)
    pairs = preference_pairs.load_pairs(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model_dir)
    args = dpo.Args(task="sums", dataset=path, model_name_or_path=chat_model_dir, output_dir=str(tmp_path / "run"))
    rendered = preference_pairs.render_prompts(pairs, tokenizer, args).train
    first = [{"role": "system", "content": tasks.INSTRUCTIONS["sums"]}, {"role": "user", "content": pairs["prompt"][0]}]
    assert len(rendered) == 400 and pairs["prompt"][0].startswith("What is ")
    assert rendered["prompt"][0] == tokenizer.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
