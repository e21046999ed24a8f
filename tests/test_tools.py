"""grpo_tools.py and tools.py: the calculator (right answers, hostile input answered with an error text in bounded time),
tool failures contained, the multi-turn rollout's bookkeeping (the environment's ids in the context but not in the
loss mask, the ids already sampled never changed), and the loss unaffected by the environment's tokens."""

import json
import random
import time
import types

import datasets
import pytest
import torch
from test_reward_funcs import FIRST, first_character_matches
from test_smoke import rows, run_here

import common
import grpo_tools
import sft
import tasks
import tools
from plumbing import models


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
    """A stand-in for common.generate: row i's k-th call writes the text turns[i][k] (EOS written "$", special tokens as
    themselves), through its first EOS of the model or stop id; every context it is called with is kept in `contexts`."""
    calls = [0]

    def generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature, stop_ids=(), done=None):
        contexts.append([ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask)])
        k, calls[0] = calls[0], calls[0] + 1
        texts = [turns[i][k] if not done[i] and k < len(turns[i]) else "" for i in range(len(prompt_ids))]
        rows = [tokenizer(t.replace("$", tokenizer.eos_token), add_special_tokens=False).input_ids for t in texts]
        ids = common.cat_padded([torch.tensor([r or [tokenizer.pad_token_id]]) for r in rows], tokenizer.pad_token_id)
        written = torch.arange(ids.shape[1]) < torch.tensor([[len(r)] for r in rows])  # (B, T)
        mask = common.completion_mask(ids, [*common.eos_token_ids(model, tokenizer), *stop_ids]) & written
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
    assert out.tool_calls.tolist() == [1, 0] and out.turns.tolist() == [2, 1]  # "so 7=" is no call: one turn, "so 7=7"
    assert out.by_model.sum(dim=1).tolist() == [len("so 12*3= it is$"), len("so 7=7$")]
    assert (out.valid & ~out.by_model).sum(dim=1).tolist() == [len(" 36"), 0]


@pytest.mark.parametrize("call_format", [tools.CompactFormat, tools.InlineFormat])
def test_a_stop_without_a_call_at_the_last_budgeted_id_ends_the_conversation(monkeypatch, call_format):
    """A turn that stops on a stop id without a call (">" after no "<", "=" after no arithmetic) exactly at the last id
    of the budget: nothing is left to write, so the conversation ends, cut by the budget (no crash on an empty turn)."""
    tokenizer = sft.build_tokenizer(sft.TOOL_CHARS)
    stray = {tools.CompactFormat: "ab>", tools.InlineFormat: "ab="}[call_format]
    contexts = []
    monkeypatch.setattr(common, "generate", scripted_generate({0: [stray, "c$"]}, contexts))
    prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, ["1*2="], torch.device("cpu"))

    class Short(Args):
        max_new_tokens = 3

    out = grpo_tools.rollout(None, tokenizer, call_format(tokenizer), prompt_ids, prompt_mask, Short, 1.0)
    assert len(contexts) == 1 and out.truncated.tolist() == [True] and out.by_model.sum().item() == 3
    assert out.final_turns == [stray] and out.turns.tolist() == [1]


def test_a_stop_without_a_call_does_not_end_the_turn(monkeypatch):
    """The rule: a turn ends at EOS or at a call. A stop id without a call is part of the turn, which goes on in the
    next round without using up one of --max-turns; the verifier reads the whole turn, the text before the stray stop
    included. (With one turn allowed, "1>" then "2" is one turn, answered "1>2", not cut.)"""
    tokenizer = sft.build_tokenizer(sft.TOOL_CHARS)
    turns = {0: ["1>", "2$"], 1: ["<2*3>", "6$"]}  # a stray stop, then the answer; a call in the only allowed turn
    monkeypatch.setattr(common, "generate", scripted_generate(turns, []))
    prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, ["1*2=", "2*3="], torch.device("cpu"))

    class OneTurn(Args):
        max_turns = 1

    out = grpo_tools.rollout(None, tokenizer, tools.CompactFormat(tokenizer), prompt_ids, prompt_mask, OneTurn, 1.0)
    assert out.final_turns == ["1>2", "<2*3>"] and out.turns.tolist() == [1, 1]
    assert out.truncated.tolist() == [False, True] and out.tool_calls.tolist() == [0, 0]
    assert out.transcripts[0] == [{"model": "1>"}, {"model": "2<eos>"}]  # one turn, written in two rounds


def test_a_call_is_answered_only_after_the_templates_end_of_turn_token(monkeypatch):
    """A chat model has several EOS ids (Qwen: <|im_end|> ends a turn, <|endoftext|> the text). The template renders a
    tool message after <|im_end|> only: a call in a turn that ends with <|endoftext|> is not answered (an answer there
    would be off-template), and the conversation ends."""
    tokenizer, eos = family_tokenizer("qwen")
    model = types.SimpleNamespace(generation_config=types.SimpleNamespace(eos_token_id=eos))
    chat = tools.ChatFormat(tokenizer, eos)
    assert tokenizer.convert_ids_to_tokens(chat.call_ends) == ["<|im_end|>"]
    turns = {0: ["<calc>2*3</calc><|endoftext|>"], 1: ["<calc>2*3</calc><|im_end|>", "6<|im_end|>"]}
    monkeypatch.setattr(common, "generate", scripted_generate(turns, []))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "2*3?"}], tokenize=False, add_generation_prompt=True)
    prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, [prompt, prompt], torch.device("cpu"))

    class Long(Args):
        max_new_tokens = 200  # one id per byte

    out = grpo_tools.rollout(model, tokenizer, chat, prompt_ids, prompt_mask, Long, 1.0)
    assert out.tool_calls.tolist() == [0, 1] and out.turns.tolist() == [1, 2] and out.truncated.tolist() == [False, False]
    assert out.final_turns == ["<calc>2*3</calc>", "6"]
    assert out.transcripts[1][1] == {
        "tool": "\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    }


def test_the_update_scores_each_sampled_id_with_the_log_prob_it_was_sampled_with(tool_model_dir, monkeypatch):
    """Across turns, the training pass over the whole conversation (prompt, the model's ids and the tool's answers, as
    grpo_tools.py builds input_ids and attention_mask) gives every id the model sampled the log-prob it was sampled with
    (common.generate, turn by turn with a KV cache): on-policy, the ratio of the first update is 1 on every model id.
    Tolerance: float32 logits of a 4-layer model, computed with and without a KV cache, differ by rounding (~1e-6); a
    shifted or misaligned id differs by whole nats."""
    model, tokenizer = models.load_model_and_tokenizer(tool_model_dir, "", torch.device("cpu"), "multiplication")
    generate, sampled_logprobs = common.generate, []

    def recording_generate(*args, **kwargs):
        ids, mask, truncated, logprobs = generate(*args, **kwargs, return_logprobs=True)
        sampled_logprobs.append((mask, logprobs))
        return ids, mask, truncated

    monkeypatch.setattr(common, "generate", recording_generate)
    torch.manual_seed(0)
    task = tasks.make_task("multiplication")
    prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, task.eval["prompt"][:64], torch.device("cpu"))
    out = grpo_tools.rollout(model, tokenizer, tools.CompactFormat(tokenizer), prompt_ids, prompt_mask, Args, 1.0)
    assert out.tool_calls.sum() > 0 and len(sampled_logprobs) > 1  # multi-turn conversations among them
    expected = [[] for _ in range(len(prompt_ids))]  # each row's sampled log-probs, in order, turn after turn
    for mask, logprobs in sampled_logprobs:
        for i in range(len(prompt_ids)):
            expected[i] += logprobs[i][mask[i]].tolist()
    input_ids = torch.cat([prompt_ids, out.completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, out.valid.long()], dim=1)
    T = out.completion_ids.shape[1]
    with torch.no_grad():
        scored, _ = common.completion_logprobs(model, input_ids, attention_mask, T, 1.0)
    for i in range(len(prompt_ids)):
        n = int(out.by_model[i].sum())  # the sampled ids kept within the budget
        assert torch.allclose(scored[i][out.by_model[i]], torch.tensor(expected[i][:n]), atol=1e-4, rtol=0)


def test_the_evaluation_runs_in_batches_and_estimates_pass_at_k_without_bias(monkeypatch):
    """10 held-out problems, 4 conversations per batch: greedy in batches of 4, 3 and 3; with --eval-samples 2, in
    batches of 2 problems (4 conversations). Each problem's first sampled answer is right and its second wrong (c = 1 of
    n = 2): the unbiased pass@1 is 1/2 and pass@2 is 1 (Chen et al. 2021); the plug-in 1 - (1 - c/n)^2 would say 0.75."""
    tokenizer = sft.build_tokenizer(sft.TOOL_CHARS)
    model = sft.build_tiny_model(tokenizer)
    sizes = []

    def answering_generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature, stop_ids=(), done=None):
        sizes.append(len(prompt_ids))
        prompts = [tokenizer.decode(ids[m.bool()]) for ids, m in zip(prompt_ids, prompt_mask)]
        products = [eval_product(p) for p in prompts]
        texts = [f"{p}$" if temperature == 0 or row % 2 == 0 else f"{p + 1}$" for row, p in enumerate(products)]
        return scripted_generate({i: [t] for i, t in enumerate(texts)}, [])(
            model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature, stop_ids, done
        )

    eval_product = lambda prompt: int(prompt[:-1].split("*")[0]) * int(prompt[:-1].split("*")[1])
    monkeypatch.setattr(common, "generate", answering_generate)
    problems = datasets.Dataset.from_dict(
        {"prompt": [f"{a}*7=" for a in range(10)], "answer": [str(7 * a) for a in range(10)]}
    )
    task = tasks.Task("multiplication", problems, problems, tasks.multiplication_answer)

    class EvalArgs(Args):
        eval_samples, temperature = 2, 1.0

    metrics = grpo_tools.evaluate(model, tokenizer, tools.CompactFormat(tokenizer), task, EvalArgs, batch_size=4)
    assert sizes == [4, 3, 3, 4, 4, 4, 4, 4]
    assert metrics["eval/accuracy"] == 1.0 and metrics["eval/pass@1"] == 0.5 and metrics["eval/pass@2"] == 1.0


# --- chat templates that know tools: each family's call format ---------------------------------------------------------

# The tool sections of three template families, shortened from the public templates of Qwen2.5-Instruct (Hermes-style
# <tool_call>), Llama-3.2-Instruct (a bare JSON object with "parameters", the answer in an `ipython` message) and
# Mistral-7B-Instruct-v0.3 ([TOOL_CALLS] and [TOOL_RESULTS], nine-character call ids): the calls and tool messages are
# written as those templates write them (Llama's tool message through `tojson`, which quotes a string and escapes its
# " and control characters); the system prompts' wording is cut.
QWEN_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a "
    "helpful assistant.{% endif %}{{ '\\n' }}\n# Tools\n\nYou are provided with function signatures within "
    "<tools></tools> XML tags:\n<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}"
    "</tools>\n\nFor each function call, return "
    'a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant"
    "{% if message.content %}{{ '\\n' }}{{ message.content }}{% endif %}"
    "{% for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}{{ '\\n' }}<tool_call>\n"
    '{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}\n</tool_call>{% endfor %}'
    "<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA_TEMPLATE = (
    "{{ bos_token }}<|start_header_id|>system<|end_header_id|>\n\n{% if tools %}Environment: ipython\n{% endif %}"
    "Cutting Knowledge Date: December 2023\n\n{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    "<|eot_id|>"
    "{% for message in messages if message.role != 'system' %}"
    "{% if message.role == 'user' and loop.first and tools %}<|start_header_id|>user<|end_header_id|>\n\nGiven the "
    "following functions, please respond with a JSON for a function call with its proper arguments that best answers "
    'the given prompt.\n\nRespond in the format {"name": function name, "parameters": dictionary of argument name and '
    "its value}. Do not use variables.\n\n{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}"
    "{{ message.content }}<|eot_id|>"
    "{% elif message.role == 'assistant' and message.tool_calls %}{% set call = message.tool_calls[0].function %}"
    '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "{{ call.name }}", "parameters": '
    "{{ call.arguments | tojson }}}<|eot_id|>"
    "{% elif message.role in ('tool', 'ipython') %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{% if message.content is mapping or message.content is iterable %}{{ message.content | tojson }}"  # a string too
    "{% else %}{{ message.content }}{% endif %}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{% if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{% set ns = namespace(last_user=0) %}{% for m in turns %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}"
    "{% endif %}{% endfor %}{{ bos_token }}{% for message in turns %}"
    "{% if message.role == 'user' %}{% if tools and loop.index0 == ns.last_user %}"
    "[AVAILABLE_TOOLS] [{% for t in tools %}{{ t | tojson }}{% endfor %}][/AVAILABLE_TOOLS]{% endif %}"
    "[INST] {% if system %}{{ system }}\n\n{% endif %}{{ message.content }}[/INST]"
    "{% elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS] ["
    "{% for tc in message.tool_calls %}{% set out = tc.function | tojson %}{{ out[:-1] }}"
    '{% if tc.id is not defined or tc.id | length != 9 %}{{ raise_exception("Tool call IDs should be alphanumeric '
    'strings with length 9!") }}{% endif %}, "id": "{{ tc.id }}"}{% endfor %}]</s>'
    "{% elif message.role == 'assistant' %}{{ message.content }}</s>"
    '{% elif message.role == \'tool\' %}[TOOL_RESULTS] {"content": {{ message.content | string }}, "call_id": '
    '"{{ message.tool_call_id }}"}[/TOOL_RESULTS]{% endif %}{% endfor %}'
)
UNKNOWN_TEMPLATE = (  # ChatML with calls written <function=NAME>{...}</function>: not a format tools.py reads
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% for tc in message.tool_calls or [] %}<function={{ tc.function.name }}>{{ tc.function.arguments | tojson }}"
    "</function>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if tools %}{# tools #}{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FAMILIES = {  # template, its special tokens (the EOS ids first, the template's end-of-turn among them), BOS
    "qwen": (QWEN_TEMPLATE, ["<|im_end|>", "<|endoftext|>", "<|im_start|>"], None),
    "llama": (
        LLAMA_TEMPLATE,
        ["<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>"],
        "<|begin_of_text|>",
    ),
    "mistral": (
        MISTRAL_TEMPLATE,
        [
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        "<s>",
    ),
}
NUM_EOS = {"qwen": 2, "llama": 3, "mistral": 1}


def byte_tokenizer(template: str, special: list[str], bos: str | None):
    """A byte-level tokenizer (every text round-trips, one id per byte) with the template's special tokens, EOS first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    kw = {"bos_token": bos} if bos else {}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=special[0], pad_token=special[0], additional_special_tokens=special[1:], **kw
    )
    tokenizer.chat_template = template
    return tokenizer


def family_tokenizer(family: str):
    template, special, bos = FAMILIES[family]
    tokenizer = byte_tokenizer(template, special, bos)
    return tokenizer, tokenizer.convert_tokens_to_ids(special[: NUM_EOS[family]])


@pytest.mark.parametrize("family", ["qwen", "llama", "mistral"])
def test_calls_in_a_templates_own_format_are_read_and_answered_on_template(family):
    """A template that knows tools describes the calculator and has the model call in its own format; tools.ChatFormat
    reads that format (Qwen/Hermes <tool_call>, Llama 3.x JSON with "parameters", Mistral [TOOL_CALLS]). A conversation
    built in ids as grpo_tools.py builds it (the rendered prompt, the call turn through its end-of-turn token, the ids
    of the tool's answer, the last turn) is, id for id, the template's rendering of the whole conversation."""
    tokenizer, eos = family_tokenizer(family)
    chat = tools.ChatFormat(tokenizer, eos, [tools.calculator])
    call_turn = chat.call_text("347 * 86")
    assert chat.find_call(call_turn) == ("calculator", {"expression": "347 * 86"})
    result, failed = tools.run_tool(tools.TOOLS, *chat.find_call(call_turn))
    assert (result, failed) == ("29842", False)
    messages = [{"role": "system", "content": "Answer."}, {"role": "user", "content": "What is 347 * 86?"}]
    render = lambda m, prompt: tokenizer.apply_chat_template(
        m, tools=[tools.calculator], tokenize=False, add_generation_prompt=prompt
    )
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    built = encode(render(messages, True)) + encode(call_turn) + chat.end_of_turn + chat.result_ids(result)
    built += encode("The answer is 29842.") + chat.end_of_turn
    call = {"name": "calculator", "arguments": {"expression": "347 * 86"}}
    messages += [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "id": tools.PROBE_CALL_ID, "function": call}],
        },
        {"role": "tool", "content": result, "tool_call_id": tools.PROBE_CALL_ID, "name": "calculator"},
        {"role": "assistant", "content": "The answer is 29842."},
    ]
    rendered = encode(render(messages, False))
    assert built == rendered[: len(built)] and tokenizer.decode(rendered[len(built) :]).strip() == ""  # (a closing "\n")


@pytest.mark.parametrize("family", ["qwen", "llama", "mistral"])
@pytest.mark.parametrize("answer", ['error: syntax: unexpected "', "error: syntax: unexpected '\x01'", "tab\there, é"])
def test_a_tools_answer_with_quotes_or_control_characters_is_shown_as_the_template_shows_it(family, answer):
    """The calculator's errors repeat the model's bad character back. Llama 3.x's template writes a tool message
    through `tojson` ("...\\"", "\\u0001"), so the answer is not in the rendered text verbatim; the environment's ids
    are still, id for id, the template's rendering of that tool message (before the fix, SystemExit ended the run)."""
    tokenizer, eos = family_tokenizer(family)
    chat = tools.ChatFormat(tokenizer, eos, [tools.calculator])
    call = {"name": "calculator", "arguments": {"expression": "1 + 1"}}
    messages = [
        {"role": "user", "content": "?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "id": tools.PROBE_CALL_ID, "function": call}],
        },
        {"role": "tool", "content": answer, "tool_call_id": tools.PROBE_CALL_ID, "name": "calculator"},
    ]
    render = lambda m, prompt: tokenizer.apply_chat_template(
        m, tools=[tools.calculator], tokenize=False, add_generation_prompt=prompt
    )
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    built = encode(render(messages[:1], True)) + encode(chat.call_text("1 + 1")) + chat.end_of_turn + chat.result_ids(answer)
    assert built == encode(render(messages, True))
    if family == "llama":
        assert json.dumps(answer, ensure_ascii=False) in tokenizer.decode(chat.result_ids(answer))


def test_llamas_end_of_message_also_ends_a_call_turn():
    """Llama 3.x may end a call turn with <|eom_id|> (its system message says "Environment: ipython" when tools are
    given): a call is answered after it as after <|eot_id|>; a family without it answers after its end of turn only."""
    tokenizer, eos = family_tokenizer("llama")
    chat = tools.ChatFormat(tokenizer, eos, [tools.calculator])
    assert tokenizer.convert_ids_to_tokens(chat.end_of_turn) == ["<|eot_id|>"]
    assert tokenizer.convert_ids_to_tokens(chat.call_ends) == ["<|eot_id|>", "<|eom_id|>"]
    tokenizer, eos = family_tokenizer("qwen")
    assert tokenizer.convert_ids_to_tokens(tools.ChatFormat(tokenizer, eos, [tools.calculator]).call_ends) == ["<|im_end|>"]
    # a vocabulary without <|eom_id|> whose unknown token is one of its EOS ids (end of text): that id still ends the
    # conversation, it is not taken for Llama's end of message
    tokenizer.unk_token = "<|endoftext|>"
    assert tokenizer.convert_ids_to_tokens(tools.ChatFormat(tokenizer, eos, [tools.calculator]).call_ends) == ["<|im_end|>"]


def test_only_a_template_that_renders_tools_gets_them():
    """The three families render the calculator's schema; a template that only mentions the word (in a comment) or
    raises when given tools is not taken for one that knows tools."""
    for family in FAMILIES:
        assert tools.template_renders_tools(family_tokenizer(family)[0])
    mentions = "{# tools #}{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    raises = "{% if tools %}{{ raise_exception('no tools') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for template in (mentions, raises):
        assert not tools.template_renders_tools(byte_tokenizer(template, ["<|im_end|>"], None))


@pytest.mark.parametrize(
    "turn, call",
    [
        (
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>',
            ("calculator", {"expression": "2*3"}),
        ),
        ('{"name": "calculator", "parameters": {"expression": "2*3"}}', ("calculator", {"expression": "2*3"})),
        ('<|python_tag|>{"name": "calculator", "parameters": {"expression": "2*3"}}', ("calculator", {"expression": "2*3"})),
        (
            '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "2*3"}, "id": "a1b2c3d4e"}]',
            ("calculator", {"expression": "2*3"}),
        ),
        ('[TOOL_CALLS]calculator[ARGS]{"expression": "2*3"}', ("calculator", {"expression": "2*3"})),
        (  # Mistral v11, two calls in one turn: the first is run
            '[TOOL_CALLS]calculator[ARGS]{"expression": "2*3"}[TOOL_CALLS]calculator[ARGS]{"expression": "4"}',
            ("calculator", {"expression": "2*3"}),
        ),
        ('[TOOL_CALLS]calculator[CALL_ID]a1b2c3d4e[ARGS]{"expression": "2*3"}', ("calculator", {"expression": "2*3"})),
        ('{"name": "Ada", "age": 36}', None),  # a JSON answer that holds a "name": not Llama's call
        ('{"name": "calculator", "parameters": {"expression": "2*3"}, "note": 1}', None),
        (
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>',
            ("calculator", {"expression": "2*3"}),
        ),
        ("<calc>2*3</calc>", ("calculator", {"expression": "2*3"})),
        ("<tool_call>{not json</tool_call>", (None, {})),
        ('{"name": ["calculator"], "parameters": {}}', (None, {})),
        ('[TOOL_CALLS] [{"name": "calculator", "arguments": [1]}]', (None, {})),
        ("The answer is 6.", None),
        ("{6}", None),
    ],
)
def test_calls_as_models_write_them_in_each_family_are_read(turn, call):
    """Calls written in each family's format, arguments as an object or (as OpenAI's API writes them) as JSON text;
    a call that cannot be read comes back to the model as an error, and text without a call is an answer."""
    tokenizer = sft.build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}<eos>{% endfor %}"
    chat = tools.ChatFormat(tokenizer, [tokenizer.eos_token_id])
    assert chat.find_call(turn) == call
    if call == (None, {}):
        assert tools.run_tool(tools.TOOLS, *call) == ("error: the call could not be read", True)


def test_a_template_whose_call_format_is_not_read_is_refused_in_one_line():
    tokenizer = byte_tokenizer(UNKNOWN_TEMPLATE, ["<|im_end|>", "<|im_start|>"], None)
    with pytest.raises(SystemExit, match=r"writes a tool call as '<function=calculator>.*a format tools.py does not read"):
        tools.ChatFormat(tokenizer, [tokenizer.eos_token_id], [tools.calculator])


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
    # a reward function of the user's own and a verifier that check the same thing (the first character of the final
    # turn against the answer), the verifier against the answers kept with the conversations, the function against its
    # `answer` column: their means agree only when the function gets the rows of the conversations it scores
    monkeypatch.setattr(tasks.Task, "verify", lambda self, c, a: first_character_matches(c, a))
    (tmp_path / "my_rewards.py").write_text(FIRST)
    flags = [*tool_run_flags, "--total-steps", "2", "--num-prompts", "4", "--group-size", "4"]
    flags += ["--eval-every", "2", "--device", "cpu", "--output-dir", str(tmp_path)]
    run_here(monkeypatch, "grpo_tools.py", *flags, "--reward-funcs", f"{tmp_path / 'my_rewards.py'}:first")

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
    assert any(r["reward/first"] > 0 for r in logged[1:])
    for r in logged[1:]:  # k / 16 of the same 16 conversations, in float32 and float64: within one float32 rounding
        assert r["reward/first"] == pytest.approx(r["rollout/gold_accuracy"], rel=1e-6)
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
    assert chat.render("2*3", "6")[1] == "\n<|im_start|>tool\n6<eos>\n<|im_start|>assistant\n"  # after the call's <eos>


def test_grpo_tools_logs_pass_at_k_of_whole_conversations(tool_run_flags, tmp_path, monkeypatch):
    """--eval-samples 2: each held-out problem is also answered twice at the sampling temperature, tool calls and all,
    and pass@1 <= pass@2 (per problem, 1 - C(n - c, k) / C(n, k) grows with k)."""
    flags = [*tool_run_flags, "--total-steps", "1", "--num-prompts", "4", "--group-size", "2", "--eval-samples", "2"]
    run_here(monkeypatch, "grpo_tools.py", *flags, "--device", "cpu", "--output-dir", str(tmp_path))
    for row in rows(tmp_path):  # step 0 and step 1, both evaluations
        assert 0 <= row["eval/pass@1"] <= row["eval/pass@2"] <= 1
