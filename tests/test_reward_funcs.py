"""Reward functions of a user's own (--reward-funcs, reward_funcs.py), conversational data (--dataset rows whose prompt
is a list of messages) with its columns mapped by flag, and a reward model with a tokenizer of its own."""

import json
import math
import os
import re
from types import SimpleNamespace

import pytest
import torch
from test_smoke import SMALL, rows, run_here

import grpo
import reward_funcs
import tasks

CPU = torch.device("cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_task(prompts, chat=False, instruction="", **columns):
    """A Task over `prompts` (strings or conversations) and extra columns, as make_task and apply_chat_template leave it:
    the rendered prompt in `prompt`, the data's own in `raw_prompt`."""
    import datasets

    data = {"prompt": [json.dumps(p) for p in prompts], "raw_prompt": prompts, "answer": ["5"] * len(prompts), **columns}
    data = datasets.Dataset.from_dict(data)
    return tasks.Task("addition", data, data, tasks.addition_answer, chat=chat, instruction=instruction)


def reward_args(*specs, weights=(), reward_model="", group_size=2):
    return SimpleNamespace(reward_funcs=specs, reward_weights=weights, reward_model=reward_model, group_size=group_size)


def write(tmp_path, source: str, name="my_rewards.py") -> str:
    path = tmp_path / name
    path.write_text(source)
    return str(path)


def test_the_reward_is_the_weighted_sum_and_a_none_counts_as_zero(tmp_path):
    """f gives 1, None, 0.5, 2 and g 0, 1, None, -1, weighted 2 and 0.5 with the verifier's 1, 0, 0, 1 at weight 3: the
    rewards are 2 + 0 + 3 = 5, 0 + 0.5 + 0 = 0.5, 1 + 0 + 0 = 1 and 4 - 0.5 + 3 = 6.5. reward/f is the mean of the values
    that apply, (1 + 0.5 + 2) / 3 = 7/6, its population std sqrt(7/18) (squares 1 + 0.25 + 4 = 5.25: 5.25/3 - 49/36)."""
    path = write(
        tmp_path, "def f(completions, **kw):\n    return [1, None, 0.5, 2]\n\ndef g(**kw):\n    return [0, 1, None, -1]\n"
    )
    task = small_task(["2+3=", "1+4="])
    functions = reward_funcs.RewardFunctions(
        reward_args(f"{path}:f", f"{path}:g", "verifier", weights=(2, 0.5, 3)), task, None, CPU
    )
    rewards, scores = functions(task.train[:2], ["5", "4", "6", "5"], torch.tensor([1.0, 0, 0, 1]), None, None)
    # each reward is a sum of at most three float32 products of small dyadic numbers: exact
    assert rewards.tolist() == [5.0, 0.5, 1.0, 6.5] and scores.shape == (4, 3) and scores[1, 0].isnan()
    metrics = functions.metrics(scores)
    assert set(metrics) == {"reward/f", "reward/f_std", "reward/g", "reward/g_std", "reward/verifier", "reward/verifier_std"}
    # float64 sums of three values, then one division: far below 1e-12
    assert metrics["reward/f"].item() == pytest.approx(7 / 6, abs=1e-12)
    assert metrics["reward/f_std"].item() == pytest.approx(math.sqrt(7 / 18), abs=1e-12)
    assert metrics["reward/g"].item() == 0.0 and metrics["reward/g_std"].item() == pytest.approx(math.sqrt(2 / 3), abs=1e-12)


def test_without_reward_funcs_the_reward_is_the_verifiers_and_nothing_more_is_logged():
    task = small_task(["2+3=", "1+4="])
    functions = reward_funcs.RewardFunctions(reward_args(), task, None, CPU)
    gold = torch.tensor([1.0, 0, 0, 1])
    rewards, scores = functions(task.train[:2], ["5", "4", "6", "5"], gold, None, None)
    assert torch.equal(rewards, gold) and functions.metrics(scores) == {}


def test_a_function_gets_the_prompts_as_given_every_column_per_completion_and_conversational_completions(tmp_path):
    """TRL's calling convention: keyword arguments; for conversational data the prompt is the data's list of messages and
    each completion a list holding the assistant's message; each column repeated for the G completions of its prompt. A
    function without **kwargs gets only what it names."""
    source = (
        "import json\nCALLS = []\n\ndef everything(prompts, completions, **columns):\n"
        "    CALLS.append(dict(prompts=prompts, completions=completions, **columns))\n    return [0.0] * len(completions)\n\n"
        "def named(completions, hint):\n    CALLS.append(dict(hint=hint))\n    return [1.0] * len(completions)\n"
    )
    path = write(tmp_path, source)
    conversations = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}],
        [{"role": "user", "content": "1+4?"}],
    ]
    task = small_task(conversations, chat=True, hint=["a", "b"])
    functions = reward_funcs.RewardFunctions(reward_args(f"{path}:everything", f"{path}:named"), task, None, CPU)
    functions(task.train[:2], ["5", "4", "6", "5"], torch.zeros(4), None, None)
    module = functions.functions["everything"].__globals__
    everything, named = module["CALLS"]
    assert everything["prompts"] == [conversations[0]] * 2 + [conversations[1]] * 2
    assert everything["completions"][1] == [{"role": "assistant", "content": "4"}]
    assert everything["hint"] == ["a", "a", "b", "b"] and everything["answer"] == ["5"] * 4 and "raw_prompt" not in everything
    assert named == {"hint": ["a", "a", "b", "b"]}


@pytest.mark.parametrize(
    "body, message",
    [
        ("    raise KeyError('solution')", r"--reward-funcs '.*:bad': raised KeyError: 'solution' \(at my_rewards.py:2\)"),
        ("    return [1.0]", r"--reward-funcs '.*:bad': returned 1 values for 4 completions"),
        (
            "    return [1.0, '1', 0.0, 0.0]",
            r"--reward-funcs '.*:bad': returned '1' for completion 1: a reward is a finite number",
        ),
        ("    return [1.0, 0.0, float('nan'), 0.0]", r"returned nan for completion 2: a reward is a finite number"),
        ("    return 1.0", r"returned '1.0', not a list of 4 numbers"),
        ("    return [1.0, 0.0, 0.0, 10**400]", r"returned 1000000000.* for completion 3: a reward is a finite number"),
    ],
)
def test_a_reward_function_that_fails_is_refused_in_one_line_naming_it(tmp_path, body, message):
    path = write(tmp_path, f"def bad(completions, **kw):\n{body}\n")
    task = small_task(["2+3=", "1+4="])
    functions = reward_funcs.RewardFunctions(reward_args(f"{path}:bad"), task, None, CPU)
    with pytest.raises(SystemExit, match=message) as info:
        functions(task.train[:2], ["5", "4", "6", "5"], torch.zeros(4), None, None)
    assert "\n" not in str(info.value.code)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("{path}", "give FILE.py:NAME, MODULE:NAME, verifier or reward_model"),
        ("nope.py:f", "no such file 'nope.py'"),
        ("{path}:missing", "has no function missing"),
        ("{broken}:f", "importing .*broken.py raised ZeroDivisionError"),
        ("{path}:needs_solution", "needs solution, which the data has not \\(it gets prompts, completions, answer\\)"),
        ("no_such_module_anywhere:f", "importing no_such_module_anywhere raised ModuleNotFoundError"),
    ],
)
def test_a_reward_function_that_cannot_be_loaded_or_called_is_refused_before_the_first_step(tmp_path, spec, message):
    path = write(tmp_path, "def needs_solution(completions, solution):\n    return [0.0] * len(completions)\n")
    broken = write(tmp_path, "1 / 0\n", "broken.py")
    with pytest.raises(SystemExit, match=message) as info:
        reward_funcs.RewardFunctions(
            reward_args(spec.format(path=path, broken=broken)), small_task(["2+3=", "1+4="]), None, CPU
        )
    assert "\n" not in str(info.value.code)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(reward_funcs=("a.py:f", "b.py:f")), "two functions share a name"),
        (dict(reward_funcs=("a.py:f", "a.py:g"), reward_weights=(1.0,)), "one finite weight for each of the 2 reward"),
        (dict(reward_funcs=("a.py:f",), reward_weights=(math.inf,)), "one finite weight for each of the 1 reward"),
        (dict(reward_funcs=("reward_model",)), "--reward-funcs reward_model: needs --reward-model"),
        (dict(reward_model="Org/rm", reward_funcs=("a.py:f",)), "list reward_model among them"),
    ],
)
def test_reward_flags_are_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(SystemExit, match=message):
        grpo.check_args(grpo.Args(output_dir=str(tmp_path), **overrides))


def test_columns_are_mapped_by_flag_and_a_missing_one_is_refused_in_one_line(tmp_path):
    data = tmp_path / "hub_like.jsonl"
    rows_ = [{"question": f"What is {a} plus 3?", "solution": a + 3, "level": a % 3} for a in range(8)]
    data.write_text("\n".join(json.dumps(r) for r in rows_))
    task = tasks.make_task("gsm8k", str(data), 2, prompt_column="question", answer_column="solution")
    row = task.train[0]
    assert row["prompt"] == row["question"] and row["answer"] == str(row["solution"]) and "level" in row
    with pytest.raises(
        SystemExit, match=r"missing column\(s\) prompt .*; name yours with --prompt-column and --answer-column"
    ):
        tasks.make_task("gsm8k", str(data), 2, answer_column="solution")
    data.write_text("\n".join(json.dumps({**r, "solution": None if i == 5 else r["solution"]}) for i, r in enumerate(rows_)))
    with pytest.raises(SystemExit, match="row 5 has no reference answer in column 'solution'"):
        tasks.make_task("gsm8k", str(data), 2, prompt_column="question", answer_column="solution")
    task = small_task(["2+3=", "1+4="], completions=["x", "y"])
    with pytest.raises(SystemExit, match="a column is called prompts or completions"):
        reward_funcs.RewardFunctions(reward_args(), task, None, CPU)


def test_an_encoders_classifier_is_refused_as_a_reward_model_in_one_line(chat_model_dir, tmp_path):
    """common.sequence_rewards reads a decoder's `score` head at the last token; BERT's classifier pools its first."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    config.num_labels = 1
    BertForSequenceClassification(config).save_pretrained(tmp_path / "bert")
    AutoTokenizer.from_pretrained(chat_model_dir).save_pretrained(tmp_path / "bert")
    with pytest.raises(SystemExit, match="a BertForSequenceClassification has no `score` head read at the last token"):
        reward_funcs.RewardFunctions(reward_args(reward_model=str(tmp_path / "bert")), small_task(["2+3=", "1+4="]), None, CPU)


def test_conversational_prompts_are_checked_and_rendered_with_their_own_system_message(chat_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    data = tmp_path / "chat.jsonl"
    own_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 plus 3?"}]
    lines = [{"prompt": own_system, "answer": 4}] + [
        {"prompt": [{"role": "user", "content": f"What is {a} plus 3?"}], "answer": a + 3} for a in range(2, 8)
    ]
    data.write_text("\n".join(json.dumps(r) for r in lines))
    data_ok = tmp_path / "chat_ok.jsonl"
    data_ok.write_text(data.read_text())
    task = tasks.apply_chat_template(tasks.make_task("gsm8k", str(data), 3), tokenizer, "auto")
    rendered = {row["raw_prompt"][-1]["content"]: row["prompt"] for row in [*task.train, *task.eval]}
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1 plus 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert rendered["What is 1 plus 3?"] == expected  # the data's own system message
    assert rendered["What is 5 plus 3?"].startswith(f"<|im_start|>system\n{tasks.INSTRUCTIONS['gsm8k']}<|im_end|>")
    with pytest.raises(
        SystemExit, match="conversations .* need a chat template; this tokenizer has one, but --chat-template is none"
    ):
        tasks.apply_chat_template(tasks.make_task("gsm8k", str(data), 3), tokenizer, "none")
    data.write_text(
        json.dumps({"prompt": [{"role": "user", "text": "hi"}], "answer": 1})
        + "\n"
        + json.dumps({"prompt": [{"role": "user", "text": "ho"}], "answer": 1})
    )
    with pytest.raises(SystemExit, match=r"row 0: the prompt must be a string or a list of \{'role', 'content'\} messages"):
        tasks.make_task("gsm8k", str(data), 1)
    assert tasks.checked_prompt([{"role": "user", "content": "a"}], "x") == [{"role": "user", "content": "a"}]
    # grpo_tools.py's way to call its tool ends every system message, the data's own too
    told = tasks.apply_chat_template(tasks.make_task("gsm8k", str(data_ok), 3), tokenizer, "auto", also_tell="Call <calc>.")
    told = [*told.train["prompt"], *told.eval["prompt"]]
    assert all("Call <calc>.<|im_end|>" in p for p in told) and any("Be brief. Call <calc>.<|im_end|>" in p for p in told)
    with pytest.raises(SystemExit, match="ends with the assistant's message"):
        tasks.checked_prompt([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "--dataset f: row 3")


def test_a_conversational_data_set_with_an_extra_column_trains_the_chat_model(chat_model_dir, tmp_path, monkeypatch):
    """grpo.py on the chat model with a data set written like a hub chat data set (conversations, the answer in
    `solution`, an extra column `unit`), a format reward that reads `unit`, and the verifier, weighted: the function sees
    the column, both are logged, and eval/accuracy counts the verifier's correct answers."""
    data = tmp_path / "chat.jsonl"
    lines = [
        {"prompt": [{"role": "user", "content": f"What is {a} plus 3?"}], "solution": a + 3, "unit": "apples"}
        for a in range(24)
    ]
    data.write_text("\n".join(json.dumps(r) for r in lines))
    source = (
        "SEEN = []\n\ndef mentions_unit(completions, unit, **kw):\n    SEEN.append(unit[0])\n"
        "    return [float(u in c[0]['content']) for c, u in zip(completions, unit)]\n"
    )
    path = write(tmp_path, source)
    out = tmp_path / "run"
    flags = ["--model-name-or-path", chat_model_dir, "--output-dir", str(out), "--max-new-tokens", "6", *SMALL]
    flags += ["--task", "gsm8k", "--dataset", str(data), "--answer-column", "solution", "--num-eval", "4"]
    flags += ["--reward-funcs", f"{path}:mentions_unit", "verifier", "--reward-weights", "0.5", "1"]
    run_here(monkeypatch, "grpo.py", *flags)
    logged = rows(out)
    assert {"reward/mentions_unit", "reward/mentions_unit_std", "reward/verifier", "reward/verifier_std"} <= set(logged[1])
    assert reward_funcs.LOADED_FILES[os.path.abspath(path)].SEEN == ["apples"] * 2  # the column, at steps 1 and 2
    with open(out / "samples.jsonl") as f:
        samples = [json.loads(line) for line in f]
    assert samples[0]["prompt"].startswith("<|im_start|>system\n") and samples[0]["answer"].isdigit()


def first_character_matches(completions, answers):
    """A verifier that is often right by chance: the completion's first character is the answer's."""
    return torch.tensor([float(c[:1] == a[:1]) for c, a in zip(completions, answers)])


FIRST = "def first(completions, answer, **kw):\n    return [float(c[:1] == a[:1]) for c, a in zip(completions, answer)]\n"


def test_dapo_gives_a_function_the_rows_of_the_completions_it_scores(model_dir, tmp_path, monkeypatch):
    """DAPO's reward lines differ from grpo.py's (its sampling rounds): the verifier and the function check the same
    thing, the verifier against the answers kept with the completions, the function against its `answer` column, so
    their means agree only when the rows are the completions' (grpo_tools.py: tests/test_tools.py)."""
    monkeypatch.setattr(tasks.Task, "verify", lambda self, c, a: first_character_matches(c, a))
    path = write(tmp_path, FIRST)
    flags = ["--model-name-or-path", model_dir, *SMALL, "--total-steps", "1", "--output-dir", str(tmp_path / "run")]
    run_here(monkeypatch, "dapo.py", *flags, "--reward-funcs", f"{path}:first")
    step = rows(tmp_path / "run")[1]
    # k / n of the same n completions in float32 (the metric pools float64): within one float32 rounding
    assert step["reward/first"] == pytest.approx(step["rollout/gold_accuracy"], rel=1e-6) and step["reward/first"] > 0
    assert step["reward/first"] == pytest.approx(step["rollout/reward_mean"], rel=1e-6)  # weight 1: the same mean


def test_maxrl_refuses_rewards_that_are_not_zero_or_one(model_dir, tmp_path, monkeypatch):
    path = write(tmp_path, "def half(completions, **kw):\n    return [0.5] * len(completions)\n")
    flags = [
        "--model-name-or-path",
        model_dir,
        "--output-dir",
        str(tmp_path / "run"),
        *SMALL,
        "--reward-funcs",
        f"{path}:half",
    ]
    with pytest.raises(SystemExit, match="maxrl.py needs rewards of 0 \\(a failure\\) or 1 \\(a success\\)"):
        run_here(monkeypatch, "maxrl.py", *flags)


def zephyr_reward_model(path):
    """A reward model with a tokenizer unlike the chat model's: another byte-level BPE vocabulary, a Zephyr-style
    template (<|user|> ... </s>) and a pad token of its own; a tiny LlamaForSequenceClassification, random weights."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = ["<pad>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([f"The sum of {a} and {b} is {a + b}" for a in range(30) for b in range(9)], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '</s>\n' }}{% endfor %}"
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    config.update(dict(num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id))
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer


def test_a_reward_model_with_its_own_tokenizer_scores_the_conversation_in_its_own_template(chat_model_dir, tmp_path):
    """The policy (ChatML) and the reward model (Zephyr-style, another vocabulary, other ids): each completion is
    scored as the reward model scores the same conversation rendered directly with its template, unpadded, through
    its own forward (transformers' pooling at the last token)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    policy_tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    rm_tokenizer = zephyr_reward_model(tmp_path / "rm")
    assert rm_tokenizer.get_vocab() != policy_tokenizer.get_vocab()
    prompts = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 plus 3?"}],
        "What is 7 plus 1?",
    ]
    task = small_task(prompts[:1], chat=True, instruction="Reply with a number.")
    task_plain = small_task(prompts[1:], chat=True, instruction="Reply with a number.")
    completions = ["The sum is 5", "5"]
    expected_conversations = [
        [*prompts[0], {"role": "assistant", "content": "The sum is 5"}],
        [*prompts[0], {"role": "assistant", "content": "5"}],
        [
            {"role": "system", "content": "Reply with a number."},
            {"role": "user", "content": "What is 7 plus 1?"},
            {"role": "assistant", "content": "The sum is 5"},
        ],
        [
            {"role": "system", "content": "Reply with a number."},
            {"role": "user", "content": "What is 7 plus 1?"},
            {"role": "assistant", "content": "5"},
        ],
    ]
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    expected = []
    for conversation in expected_conversations:
        ids = rm_tokenizer(
            rm_tokenizer.apply_chat_template(conversation, tokenize=False), add_special_tokens=False, return_tensors="pt"
        )
        with torch.no_grad():
            expected.append(model(**ids).logits[0, 0].item())
    scored = []
    for t in (task, task_plain):
        functions = reward_funcs.RewardFunctions(reward_args(reward_model=str(tmp_path / "rm")), t, policy_tokenizer, CPU)
        assert not functions.same_tokenizer
        scored += functions(t.train[:1], completions, torch.zeros(2), None, None)[0].tolist()
    assert len(set(expected)) == 4  # four different conversations, four different scores
    # the same fp32 forward over the same ids, once right-padded in a batch and once alone: differences of float rounding
    assert scored == pytest.approx(expected, abs=1e-5)


def test_grpo_engine_scores_each_batch_sampled_ahead_with_its_own_rows(model_dir, tmp_path, monkeypatch):
    """With --max-staleness 2 the engine samples two batches ahead of the trainer: the rows a reward function gets are
    those of the batch being trained on. The verifier and the function both check the completion's first character
    against the reference answer (often right by chance): the verifier reads the answers kept with the batch, the
    function its own `answer` column, so their means agree at every step only when the rows travel with their batch."""
    monkeypatch.setattr(tasks.Task, "verify", lambda self, c, a: first_character_matches(c, a))
    path = write(tmp_path, FIRST)
    out = tmp_path / "run"
    flags = ["--model-name-or-path", model_dir, "--output-dir", str(out), *SMALL, "--total-steps", "4", "--eval-every", "4"]
    run_here(monkeypatch, "grpo_engine.py", *flags, "--max-staleness", "2", "--reward-funcs", f"{path}:first")
    logged = rows(out)[1:]
    assert len(logged) == 4 and any(r["reward/first"] > 0 for r in logged)
    for r in logged:  # k / 16 of the same 16 completions, each in float32 and float64: exact
        assert r["reward/first"] == r["rollout/gold_accuracy"]


def test_the_docs_reward_function_and_examples_score_as_they_say():
    """The function of docs/your-model-and-data.md, and those of examples/, on completions whose scores are known."""
    with open(os.path.join(ROOT, "docs", "your-model-and-data.md")) as f:
        source = re.search(r"```python\n# my_rewards.py\n(.*?)```", f.read(), re.DOTALL).group(1)
    namespace = {}
    exec(source, namespace)  # the page's own code, as a user pastes it into a file
    replies = [[{"role": "assistant", "content": text}] for text in ("19 + 57 = 76", "It is 76.", "a = 1\nb = 2", "= 95.")]
    assert namespace["format_reward"](replies) == [1.0, 0.0, 0.0, 1.0]
    r1 = reward_funcs.load_reward_function(os.path.join(ROOT, "examples", "r1_rewards.py") + ":format_reward")
    assert r1(replies) == [1.0, 0.0, 0.0, 1.0]
    accuracy = reward_funcs.load_reward_function(os.path.join(ROOT, "examples", "r1_rewards.py") + ":accuracy_reward")
    assert accuracy(replies, solution=["76", "76", "2", "76"]) == [1.0, 1.0, 1.0, 0.0]
    partial = reward_funcs.load_reward_function(os.path.join(ROOT, "examples", "partial_credit.py") + ":digits_in_place")
    assert partial(["25", "26", "2", "2699"], answer=["25"] * 4) == [1.0, 0.5, 0.5, 0.25]  # reversed digits of 52


def test_the_pages_tables_are_the_benchmarks_from_its_records():
    """The R1-style and partial-credit tables of docs/your-model-and-data.md are what benchmark_reward_funcs.py prints
    from the records kept in docs/real-model/reward-funcs-runs/, every seed recorded."""
    from benchmarks import benchmark_reward_funcs

    with open(os.path.join(ROOT, "docs", "your-model-and-data.md")) as f:
        page = f.read()
    for part, table in (("r1", benchmark_reward_funcs.r1_table), ("partial", benchmark_reward_funcs.partial_table)):
        seeds = sorted(
            int(n[len(part) + 5 : -6]) for n in os.listdir(benchmark_reward_funcs.RECORDS) if n.startswith(f"{part}-seed")
        )
        assert seeds == [1, 2, 3], part
        for line in table(seeds):
            assert line in page, line
