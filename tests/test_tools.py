"""grpo_tools.py and tools.py: the calculator (right answers, hostile input answered with an error text in bounded time),
tool failures contained, the multi-turn rollout's bookkeeping (the environment's ids in the context but not in the
loss mask, the ids already sampled never changed), and the loss unaffected by the environment's tokens."""

import json
import random
import time

import pytest
import torch
from test_smoke import rows, run_here

import common
import grpo_tools
import sft
import tasks
import tools


def answer(expression: str) -> tuple[str, bool]:
    return tools.run_tool(tools.TOOLS, "calculator", {"expression": expression})


@pytest.mark.parametrize(
    "expression, result",
    [
        ("347*86", "29842"),  # 347 * 80 + 347 * 6 = 27760 + 2082
        ("347 * 86", "29842"),
        ("(2 + 3) ** 2", "25"),
        ("2 + 3 * 4", "14"),  # * before +
        ("2 ** 3 ** 2", "512"),  # ** from the right: 2^9, not 8^2
        ("-2 ** 2", "-4"),  # ** before the sign, as in Python
        ("7 / 2", "3.5"),
        ("1 / 3", "0.333333"),  # six decimals
        ("2 ** -2", "0.25"),
        ("10 - 4 - 3", "3"),  # from the left
        ("12 × 3 ÷ 4", "9"),
        ("2.9999999 * 1", "3"),  # six decimals, no trailing point
        ("0 - 0.0000001", "0"),  # no "-0"
        ("(-1) ** (10 ** 90)", "1"),  # a huge power of -1 is not computed by repeated multiplication
    ],
)
def test_the_calculator_computes_exactly(expression, result):
    assert answer(expression) == (result, False)


HOSTILE = [
    "9**9**9",  # Python would work on this for hours and gigabytes
    "10**101",
    "99999999999**99999999999",
    "0.5 ** -1000",
    "2 ** 0.5",
    "1 / 0",
    "0 ** -1",
    "(" * 100 + "1" + ")" * 100,  # deeper than the parser allows
    "-" * 150 + "1",
    "1" * 150,  # a 150-digit number
    "1" + "+1" * 1000,  # longer than allowed
    "__import__('os').system('true')",
    "().__class__.__bases__[0].__subclasses__()",
    "open('/etc/passwd').read()",
    "x",
    "abs(-3)",
    "1 if 1 else 0",
    "lambda: 1",
    "2 +",
    "((2)",
    "2 ** ** 2",
    "",
    "1e308 * 10",
    "1.00000000000000001 ** 99999999",  # a base near 1: its power's size is bounded on the bit lengths, not on a float
    "0.99999999999999999 ** -99999999",
    "2 ** 400",
]


@pytest.mark.parametrize("expression", HOSTILE)
def test_hostile_expressions_are_answered_with_an_error(expression):
    """Each within 1 s: it takes microseconds, where `eval` of the first would take hours."""
    start = time.monotonic()
    text, failed = answer(expression)
    assert failed and text.startswith("error: ") and time.monotonic() - start < 1


def test_random_expressions_never_raise_and_stay_within_a_time_bound():
    """2,000 random strings of arithmetic characters and a few others, up to 80 long: each is answered, with a number or
    an error text, and all of them together within 10 s. Every number stays below 10^100 and every power is bounded
    before it is computed, so even the worst of them costs well under a millisecond; 10 s is loose enough for any
    machine, and one unbounded power would take hours."""
    rng = random.Random(0)
    alphabet = "0123456789" * 3 + "+-*/()** ." + "a_[]"
    start = time.monotonic()
    for _ in range(2000):
        expression = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 80)))
        text, failed = answer(expression)
        assert failed == text.startswith("error: ")
        assert failed or float(text) == float(text)  # a number: finite, not NaN
    assert time.monotonic() - start < 10


def test_a_tool_that_raises_or_is_unknown_answers_with_an_error():
    def broken(x: int) -> str:
        raise RuntimeError("bug")

    kit = {"broken": broken, **tools.TOOLS}
    assert tools.run_tool(kit, "broken", {"x": 1}) == ("error: broken raised RuntimeError", True)
    assert tools.run_tool(kit, "weather", {}) == ("error: unknown tool weather", True)
    assert tools.run_tool(kit, "calculator", {"text": "1"})[1]  # wrong arguments
    assert tools.run_tool(kit, None, {})[1]  # a call that could not be read


def test_the_compact_format_reads_a_call_and_writes_its_answer():
    tokenizer = sft.build_tokenizer(sft.TOOL_CHARS)
    compact = tools.CompactFormat(tokenizer)
    assert tokenizer.convert_ids_to_tokens(compact.stop_ids) == [">"]
    assert compact.find_call("<347*86>") == ("calculator", {"expression": "347*86"})
    assert compact.find_call("29842") is None
    assert tokenizer.decode(compact.result_ids("29842")) == "[29842]"


# --- the rollout ------------------------------------------------------------------------------------------------------


class Args:
    max_turns, max_new_tokens = 3, 64


def scripted_generate(turns: dict, contexts: list):
    """A stand-in for common.generate: row i's k-th turn is the text turns[i][k] (EOS written "$"); every context it is
    called with is kept in `contexts`."""
    calls = [0]

    def generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature, stop_ids=(), done=None):
        contexts.append([ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask)])
        k, calls[0] = calls[0], calls[0] + 1
        texts = [turns[i][k] if not done[i] and k < len(turns[i]) else "" for i in range(len(prompt_ids))]
        ids = [tokenizer(t.replace("$", "<eos>"), add_special_tokens=False).input_ids for t in texts]
        ids = common.cat_padded([torch.tensor([i or [tokenizer.pad_token_id]]) for i in ids], tokenizer.pad_token_id)
        mask = common.completion_mask(ids, [tokenizer.eos_token_id, *stop_ids]) & (ids != tokenizer.pad_token_id)
        return ids, mask, torch.zeros(len(ids), dtype=torch.bool)

    return generate


@pytest.fixture
def conversations(monkeypatch):
    tokenizer = sft.build_tokenizer(sft.TOOL_CHARS)
    model = sft.build_tiny_model(tokenizer)
    turns = {
        0: ["<12*3>", "36$"],  # a call, then the answer
        1: ["41$"],  # a guess
        2: ["<1/0>", "<2**-1>", "0.5$"],  # an error, another call, then the answer
        3: ["<5*5>", "<6*6>", "<7*7>"],  # a call in the last turn: no turn left to read its answer
    }
    contexts = []
    monkeypatch.setattr(common, "generate", scripted_generate(turns, contexts))
    prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, ["12*3=", "4*9=", "1*2=", "5*5="], torch.device("cpu"))
    out = grpo_tools.rollout(model, tokenizer, tools.CompactFormat(tokenizer), prompt_ids, prompt_mask, Args, 1.0)
    return tokenizer, out, contexts, prompt_ids, prompt_mask


def test_the_rollout_appends_each_answer_and_masks_only_the_environments_ids(conversations):
    tokenizer, out, _, _, _ = conversations
    text = lambda i, where: "".join(tokenizer.convert_ids_to_tokens(out.completion_ids[i][where[i]].tolist())).replace(
        "<eos>", "$"
    )
    assert [text(i, out.valid) for i in range(4)] == [
        "<12*3>[36]36$",
        "41$",
        "<1/0>[error: division by zero]<2**-1>[0.5]0.5$",
        "<5*5>[25]<6*6>[36]<7*7>",
    ]
    assert [text(i, out.by_model) for i in range(4)] == ["<12*3>36$", "41$", "<1/0><2**-1>0.5$", "<5*5><6*6><7*7>"]
    assert out.final_turns == ["36", "41", "0.5", "<7*7>"]
    assert out.tool_calls.tolist() == [1, 0, 2, 2] and out.tool_errors.tolist() == [0, 0, 1, 0]
    assert out.turns.tolist() == [2, 1, 3, 3] and out.truncated.tolist() == [False, False, False, True]
    assert out.transcripts[0] == [{"model": "<12*3>"}, {"tool": "[36]"}, {"model": "36<eos>"}]


def test_the_ids_already_sampled_never_change_between_turns(conversations):
    """Each turn's context is the previous turn's context, then what the model sampled and the tool's answer: never
    re-tokenized from text."""
    tokenizer, out, contexts, prompt_ids, prompt_mask = conversations
    assert len(contexts) == 3
    row = 0  # "12*3=" -> "<12*3>" -> "[36]" -> "36$"
    prompt = prompt_ids[row][prompt_mask[row].bool()].tolist()
    whole = prompt + out.completion_ids[row][out.valid[row]].tolist()
    assert contexts[0][row] == prompt and contexts[1][row] == whole[: len(contexts[1][row])]
    assert contexts[1][row] == prompt + tokenizer("<12*3>[36]", add_special_tokens=False).input_ids


def test_a_conversation_stops_at_its_token_budget(monkeypatch):
    tokenizer = sft.build_tokenizer(sft.TOOL_CHARS)
    monkeypatch.setattr(common, "generate", scripted_generate({0: ["<99*99>", "9801$"]}, []))
    prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, ["99*99="], torch.device("cpu"))

    class Short(Args):
        max_new_tokens = 10  # "<99*99>" is 7 ids, "[9801]" 6: the answer is cut after 3 ids

    out = grpo_tools.rollout(None, tokenizer, tools.CompactFormat(tokenizer), prompt_ids, prompt_mask, Short, 1.0)
    assert out.valid.sum().item() == 10 and out.by_model.sum().item() == 7 and out.truncated.tolist() == [True]


def test_the_inline_format_completes_arithmetic_in_the_reply(monkeypatch):
    """Toolformer-style: the turn stops at "=", the calculator's result is written into the reply, the model goes on,
    and the verifier reads the whole reply; an "=" after no arithmetic is not a call, and the model goes on as well."""
    tokenizer = sft.build_tokenizer(sft.TOOL_CHARS)
    inline = tools.InlineFormat(tokenizer)
    assert tokenizer.convert_ids_to_tokens(inline.stop_ids) == ["="]
    turns = {0: ["so 12*3=", " it is$"], 1: ["so 7=", "7$"]}
    monkeypatch.setattr(common, "generate", scripted_generate(turns, []))
    prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, ["12*3=", "7+0="], torch.device("cpu"))
    out = grpo_tools.rollout(None, tokenizer, inline, prompt_ids, prompt_mask, Args, 1.0)
    assert out.final_turns == ["so 12*3= 36 it is", "so 7=7"]
    assert out.tool_calls.tolist() == [1, 0] and out.turns.tolist() == [2, 2]
    assert out.by_model.sum(dim=1).tolist() == [len("so 12*3= it is$"), len("so 7=7$")]
    assert (out.valid & ~out.by_model).sum(dim=1).tolist() == [len(" 36"), 0]


# --- the loss is blind to the environment's tokens --------------------------------------------------------------------


def loss_and_gradient(logprobs, old, ref, advantages, mask, beta=0.04):
    class A:
        clip_eps = 0.2

    A.beta = beta
    logprobs = logprobs.clone().requires_grad_(True)
    loss, metrics = grpo_tools.compute_loss(logprobs, old, ref, advantages, mask, A)
    loss.backward()
    return loss.detach(), logprobs.grad, metrics


def test_the_environments_tokens_change_nothing_in_the_loss():
    """Two conversations in float64, the model's ids at columns marked True. Whatever the log-probs of the environment's
    ids are (here garbage, up to NaN and inf), the loss, its gradient, the KL term and every per-token metric and count
    are exactly unchanged, and the gradient on those columns is exactly 0; and they equal (to float64 rounding) those of
    the same conversations with the environment's columns removed."""
    torch.manual_seed(0)
    by_model = torch.tensor([[1, 1, 0, 0, 0, 1, 1], [1, 0, 0, 1, 1, 1, 0]], dtype=torch.bool)
    logprobs, old, ref = (-torch.rand(2, 7, dtype=torch.float64) * 2 for _ in range(3))
    advantages = torch.tensor([0.7, -1.3], dtype=torch.float64)
    loss, grad, metrics = loss_and_gradient(logprobs, old, ref, advantages, by_model)

    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30] * 3, dtype=torch.float64)[:7]
    poisoned = [torch.where(by_model, x, garbage) for x in (logprobs, old, ref)]
    loss_p, grad_p, metrics_p = loss_and_gradient(*poisoned, advantages, by_model)
    assert torch.equal(loss, loss_p) and torch.equal(grad, grad_p) and (grad[~by_model] == 0).all()
    assert metrics.keys() == metrics_p.keys() and all(torch.equal(metrics[k], metrics_p[k]) for k in metrics)

    # the environment's columns removed: each row's model ids alone, left-aligned (row 2 has 4, row 1 has 4)
    compact = lambda x: torch.stack([row[keep] for row, keep in zip(x, by_model)])
    loss_c, grad_c, metrics_c = loss_and_gradient(*(compact(x) for x in (logprobs, old, ref)), advantages, compact(by_model))
    # float64 sums of at most 7 terms of size below 10: a different order of summation moves them by far less than 1e-12
    close = lambda x, y: torch.allclose(x, y, rtol=1e-12, atol=1e-12)
    assert close(loss, loss_c) and close(compact(grad), grad_c)
    assert all(close(metrics[k], metrics_c[k]) for k in metrics)
    assert len(metrics["kl/ref"]) == by_model.sum() == 8  # one KL sample per model token


# --- end to end -------------------------------------------------------------------------------------------------------


def test_grpo_tools_end_to_end(tool_run_flags, tmp_path, monkeypatch):
    """Two steps through the command line. Every id the model sampled is scored in the update in exactly the context it
    was sampled in: each sampled turn (its context, the tool's answers included, then its new ids) starts a row of ids
    that the training pass attends to; with the loss mask as the attention mask instead, the tool's answers would be
    missing from those rows. The loss counts the model's ids only (rollout/response_length, from the loss mask, equals
    rollout/tokens_by_model)."""
    sampled, scored = [], []
    generate, completion_logprobs = common.generate, common.completion_logprobs

    def recording_generate(model, tokenizer, ids, mask, max_new_tokens, temperature, stop_ids=(), done=None):
        out = generate(model, tokenizer, ids, mask, max_new_tokens, temperature, stop_ids, done)
        if temperature > 0:  # (not the greedy evaluation)
            for row, (i, m, o, om) in enumerate(zip(ids, mask, out[0], out[1])):
                if done is None or not done[row]:
                    sampled.append((i[m.bool()].tolist(), o[om].tolist()))
        return out

    def recording_logprobs(model, input_ids, attention_mask, *more):
        if torch.is_grad_enabled():  # the update's pass
            scored.extend(tuple(i[m.bool()].tolist()) for i, m in zip(input_ids, attention_mask))
        return completion_logprobs(model, input_ids, attention_mask, *more)

    monkeypatch.setattr(common, "generate", recording_generate)
    monkeypatch.setattr(common, "completion_logprobs", recording_logprobs)
    flags = [*tool_run_flags, "--total-steps", "2", "--num-prompts", "4", "--group-size", "4"]
    flags += ["--eval-every", "2", "--device", "cpu", "--output-dir", str(tmp_path)]
    run_here(monkeypatch, "grpo_tools.py", *flags)

    assert len(sampled) > 2 * 16  # more turns than conversations: some called the tool
    for context, new in sampled:
        assert any(
            row[: len(context)] == tuple(context) and row[len(context) : len(context) + 1] == tuple(new[:1]) for row in scored
        )
    logged = rows(tmp_path)
    assert [r["step"] for r in logged] == [0, 1, 2]
    for key in ("rollout/tool_calls", "rollout/called_tool_frac", "eval/tool_errors", "train/environment_logprob"):
        assert key in logged[-1], key
    assert sum(r["rollout/tokens_by_environment"] for r in logged[1:]) > 0
    for r in logged[1:]:
        # float32 means of the same integer counts: the sums are exact (< 2^24), one division each, < u = 6e-8 relative
        assert r["rollout/response_length"] == pytest.approx(r["rollout/tokens_by_model"], rel=1e-6)
    with open(tmp_path / "samples.jsonl") as f:
        sample = json.loads(f.readline())
    assert sample["prompt"].endswith("=") and sample["turns"] and "model" in sample["turns"][0]


def test_the_multiplication_task_needs_the_tool():
    task = tasks.make_multiplication_task(num_eval=100, num_problems=4000)  # the default's recipe on fewer problems
    row = task.train[0]
    a, b = (int(n) for n in row["prompt"].rstrip("=").split("*"))
    assert row["answer"] == str(a * b) and 100 <= a < 1000 and 10 <= b < 100
    share = sum(s.startswith("<") for s in task.train["solution"]) / len(task.train)
    assert 0.2 < share < 0.3  # a quarter of the warm-up's solutions call the tool
    assert tasks.multiplication_answer("<347*86>[29842]29842") == "29842"
    assert tasks.multiplication_answer("<347*86>[29842]") is None and tasks.multiplication_answer("29842") == "29842"
    assert sft.written_by_environment("1*2=<1*2>[2]2") == [False] * 9 + [True] * 3 + [False]


def test_bad_flags_are_refused_in_one_line():
    with pytest.raises(SystemExit, match="--max-turns 0: must be at least 1"):
        grpo_tools.check_args(grpo_tools.Args(max_turns=0))
    with pytest.raises(SystemExit, match="--tool-format json: allowed values are auto, compact, chat, inline"):
        grpo_tools.check_args(grpo_tools.Args(tool_format="json"))
    with pytest.raises(SystemExit, match="--task addition: the built-in model calls tools on multiplication only"):
        grpo_tools.check_args(grpo_tools.Args(task="addition"))
    with pytest.raises(SystemExit, match="--group-size 1: needs at least 2"):
        grpo_tools.check_args(grpo_tools.Args(group_size=1))


def test_a_template_that_knows_tools_describes_the_calculator_from_its_docstring():
    """With a chat template that renders `tools`, the prompt carries the calculator's JSON schema (name, description and
    typed arguments, read by transformers from the function itself), and a <tool_call> of that template is run."""
    import datasets

    tokenizer = sft.build_tokenizer()
    tokenizer.chat_template = (  # ChatML-like, its turns ended by the built-in tokenizer's EOS
        "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<eos>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    rows = datasets.Dataset.from_dict({"prompt": ["What is 2 * 3?"], "answer": ["6"]})
    prompt = tasks.apply_chat_template(tasks.Task("t", rows, rows, str), tokenizer, "on", "Answer.", [tools.calculator])
    text = prompt.train[0]["prompt"]
    assert '"name": "calculator"' in text and '"expression"' in text and "Evaluate an arithmetic expression" in text
    chat = tools.ChatFormat(tokenizer, [tokenizer.eos_token_id])
    call = chat.find_call('<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>')
    assert call == ("calculator", {"expression": "2*3"}) and tools.run_tool(tools.TOOLS, *call) == ("6", False)
    assert tools.run_tool(tools.TOOLS, *chat.find_call("<tool_call>{not json</tool_call>")) == (
        "error: unknown tool None",
        True,
    )
    assert chat.before + "6" + chat.after == "\n<|im_start|>tool\n6<eos>\n<|im_start|>assistant\n"


def test_grpo_tools_logs_pass_at_k_of_whole_conversations(tool_run_flags, tmp_path, monkeypatch):
    """--eval-samples 2: each held-out problem is also answered twice at the sampling temperature, tool calls and all,
    and pass@1 <= pass@2 (per problem, 1 - C(n - c, k) / C(n, k) grows with k)."""
    flags = [*tool_run_flags, "--total-steps", "1", "--num-prompts", "4", "--group-size", "2", "--eval-samples", "2"]
    run_here(monkeypatch, "grpo_tools.py", *flags, "--device", "cpu", "--output-dir", str(tmp_path))
    for row in rows(tmp_path):  # step 0 and step 1, both evaluations
        assert 0 <= row["eval/pass@1"] <= row["eval/pass@2"] <= 1
