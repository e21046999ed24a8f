"""Tools a model may call during a rollout (grpo_tools.py), and the three formats in which it calls them.

A tool is a plain Python function with a name, a docstring and typed arguments; it returns text. The calculator is the
one shipped here. What a model writes is untrusted input, like anything a user types into a web form: a model that
is rewarded for right answers will write whatever gets them, and a sampled model also writes garbage. So the
calculator never hands model text to `eval` (which would run any Python, `__import__('os').system(...)` included): it
parses arithmetic itself, and it bounds the length of the expression, its nesting and the size of every number
(a power's size is bounded before it is computed), so that `9**9**9` is refused at once instead of filling the memory,
and the time of a call is bounded by construction: at most 200 tokens, each read once, each operation on numbers of at
most a few hundred bits (a wall-clock limit would make the answers depend on the machine's load). Every failure, of
the calculator or of any tool (an unknown tool, a tool that raises), goes back to the model as the tool's answer,
"error: ...", and is counted; none stops the run.

The three call formats (one rollout loop, see grpo_tools.py):
- CompactFormat, for the built-in model and its character vocabulary: the model writes <347*86>, which ends its turn
  (the ">" is a stop token), and the environment appends the answer in brackets, [29842].
- ChatFormat, for a chat model: the model ends its turn as usual (end-of-turn token) with a call in it, <calc>347 *
  86</calc>, or, with a template that knows tools, a call in that template's own format (Qwen/Hermes, Llama 3.x or
  Mistral, read_json_call); the environment appends the answer as a `tool` message rendered by the model's own chat
  template, followed by the opening of the next assistant turn. Only that suffix is tokenized: the ids already in the
  context never change.
- InlineFormat, for a chat model that writes arithmetic but no call format: in the spirit of Toolformer (Schick et al.
  2023), the model writes "347 * 86 =" in its reply, the turn stops at the "=", and the calculator writes " 29842" into
  the reply; the model goes on from there.
"""

import json
import re
from fractions import Fraction

import tasks

# ---------------------------------------------------------------------------------------------------------------------
# The calculator: arithmetic parsed by hand, every resource bounded
# ---------------------------------------------------------------------------------------------------------------------

MAX_CHARS = 200  # longest expression read
MAX_DEPTH = 30  # deepest nesting of parentheses and signs
MAX_DIGITS = 100  # numerators and denominators of every number, result or anything in between stay below 10^100
MAX_BITS = 333  # 10^100 < 2^333: a power surely larger is refused before it is computed


class ToolError(Exception):
    """A failure the model is told about, as the tool's answer."""


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Args:
        expression: integers or decimals with + - * / ** and parentheses, for example "347 * 86" or "(2 + 3) ** 2"
    """
    if not isinstance(expression, str):
        raise ToolError("the expression must be text")
    if len(expression) > MAX_CHARS:
        raise ToolError(f"expression longer than {MAX_CHARS} characters")
    tokens = re.findall(r"\d+(?:\.\d+)?|\*\*|\S", expression.replace("×", "*").replace("÷", "/"))
    parser = _Parser(tokens)
    value = parser.sum(depth=0)
    if parser.pos != len(tokens):
        raise ToolError(f"syntax: unexpected {tokens[parser.pos][:20]}")
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.6f}".rstrip("0").rstrip(".")  # a fraction: rounded to six decimals
    return "0" if text == "-0" else text


def _bounded(value: Fraction) -> Fraction:
    if abs(value.numerator) >= 10**MAX_DIGITS or value.denominator >= 10**MAX_DIGITS:
        raise ToolError("number too large")
    return value


class _Parser:
    """Recursive descent over the grammar, the usual precedence (** binds tighter than a sign, as in Python):
    sum := product (("+" | "-") product)*    product := signed (("*" | "/") signed)*
    signed := ("+" | "-") signed | power      power := atom ("**" signed)?      atom := number | "(" sum ")" """

    def __init__(self, tokens: list[str]):
        self.tokens, self.pos = tokens, 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ToolError("syntax: the expression ends too early")
        self.pos += 1
        return token

    def check(self, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise ToolError(f"nested deeper than {MAX_DEPTH}")

    def sum(self, depth: int) -> Fraction:
        value = self.product(depth)
        while self.peek() in ("+", "-"):
            value = _bounded(value + self.product(depth) if self.take() == "+" else value - self.product(depth))
        return value

    def product(self, depth: int) -> Fraction:
        value = self.signed(depth)
        while self.peek() in ("*", "/"):
            op, right = self.take(), self.signed(depth)
            if op == "/" and right == 0:
                raise ToolError("division by zero")
            value = _bounded(value * right if op == "*" else value / right)
        return value

    def signed(self, depth: int) -> Fraction:
        self.check(depth)
        if self.peek() in ("+", "-"):
            return -self.signed(depth + 1) if self.take() == "-" else self.signed(depth + 1)
        return self.power(depth)

    def power(self, depth: int) -> Fraction:
        base = self.atom(depth)
        if self.peek() != "**":
            return base
        self.take()
        exponent = self.signed(depth + 1)
        if exponent.denominator != 1:
            raise ToolError("only whole-number powers")
        if base == 0:
            if exponent < 0:
                raise ToolError("division by zero")
            return Fraction(int(exponent == 0))
        if abs(base) == 1:  # 1 or -1 to any power, however large
            return Fraction(1 if base == 1 or exponent.numerator % 2 == 0 else -1)
        # the size of the result before computing it: n >= 2^(bits of n - 1), so n^e has more than e (bits - 1) bits
        if abs(exponent.numerator) * (max(abs(base.numerator).bit_length(), base.denominator.bit_length()) - 1) > MAX_BITS:
            raise ToolError("number too large")
        return _bounded(base**exponent.numerator)

    def atom(self, depth: int) -> Fraction:
        token = self.take()
        if token == "(":
            self.check(depth + 1)
            value = self.sum(depth + 1)
            if self.take() != ")":
                raise ToolError("syntax: missing )")
            return value
        if re.fullmatch(r"\d+(?:\.\d+)?", token):
            if len(token) > MAX_DIGITS:
                raise ToolError("number too large")
            return Fraction(token)
        raise ToolError(f"syntax: unexpected {token[:20]}")


TOOLS = {"calculator": calculator}  # the tools a model may call, by name


def run_tool(tools: dict, name: str | None, arguments: dict) -> tuple[str, bool]:
    """Call the tool `name` with `arguments`: (its answer, whether it failed). Nothing a tool does can stop the run: an
    unknown tool, wrong arguments or any exception come back as the answer "error: ...", to be shown to the model."""
    if name is None:
        return "error: the call could not be read", True
    if name not in tools:
        return f"error: unknown tool {re.sub(r'[^A-Za-z0-9_]', '', str(name))[:40]}", True
    try:
        return str(tools[name](**arguments)), False
    except ToolError as e:
        return f"error: {e}", True
    except Exception as e:  # a tool's own bug, or arguments it does not take: contained, told to the model
        return f"error: {name} raised {type(e).__name__}", True


# ---------------------------------------------------------------------------------------------------------------------
# Call formats: where a model's turn stops, how a call is read from it, which ids the environment appends
# ---------------------------------------------------------------------------------------------------------------------


class CompactFormat:
    """For a model without a chat template (the built-in model): "<EXPRESSION>" calls the calculator and ends the turn;
    the environment appends "[RESULT]". "347*86=" -> model "<347*86>" -> environment "[29842]" -> model "29842"."""

    inline = False  # the verifier reads the model's last turn

    def __init__(self, tokenizer, eos_ids=()):
        self.tokenizer = tokenizer
        self.stop_ids = tokenizer(">", add_special_tokens=False).input_ids  # a turn also ends where a call closes
        self.call_ends = self.stop_ids  # the ids after which a call is answered
        marks = [tokenizer(c, add_special_tokens=False).input_ids for c in "<>[]"]
        if any(len(ids) != 1 or ids[0] == tokenizer.unk_token_id for ids in marks):
            raise SystemExit(
                "the compact tool-call format needs <, >, [ and ] as tokens of the model's vocabulary: use the built-in "
                "model on --task multiplication, or a chat model (its template carries the calls)"
            )

    def find_call(self, turn: str) -> tuple[str, dict] | None:
        """The call that ends this turn of the model, as (tool name, arguments), or None: the model answered."""
        if not turn.endswith(">") or "<" not in turn:
            return None
        return "calculator", {"expression": turn[turn.rindex("<") + 1 : -1]}

    def result_ids(self, result: str) -> list[int]:
        return self.tokenizer(f"[{result}]", add_special_tokens=False).input_ids


PROBE_CALL_ID = "call00001"  # a tool call's id where a template wants one (Mistral's: nine letters or digits)


def read_json_call(turn: str) -> tuple[str | None, dict] | None:
    """A call written in the format of a chat template that knows tools, as (tool name, arguments); None when the turn
    holds no such call, (None, {}) when it holds one that cannot be read (not JSON, no name, arguments not an object).
    The formats of the major template families (one call per turn: the first is run):
    - Qwen2.5 and Hermes: <tool_call>{"name": "calculator", "arguments": {"expression": "347 * 86"}}</tool_call>
    - Llama 3.x: the turn is one JSON object with exactly the keys "name" and "parameters" (or "arguments"), after
      <|python_tag|> or not; any other JSON object is an answer, not a call
    - Mistral: [TOOL_CALLS] [{"name": "calculator", "arguments": {...}, "id": "..."}], or (tokenizers v11 and later)
      [TOOL_CALLS]calculator[ARGS]{...}, or with a call id, [TOOL_CALLS]calculator[CALL_ID]a1b2c3d4e[ARGS]{...}
    Arguments may also come as JSON text of an object, as OpenAI's API writes them."""
    bare = turn.replace("<|python_tag|>", "").strip()
    if match := re.search(r"<tool_call>(.*?)</tool_call>", turn, re.DOTALL):
        text = match.group(1)
    elif "[TOOL_CALLS]" in turn:
        text = turn.split("[TOOL_CALLS]")[1]  # the first call (v11 writes each call after its own [TOOL_CALLS])
        if "[ARGS]" in text:  # Mistral's later tokenizers: the name (and the call's id), then the arguments
            name, _, arguments = text.partition("[ARGS]")
            text = json.dumps({"name": name.partition("[CALL_ID]")[0].strip(), "arguments": arguments.strip()})
    elif bare.startswith("{") and bare.endswith("}") and '"name"' in bare:
        text = bare
    else:
        return None
    try:  # model text: json.loads reads it without running it; too deep a nesting raises, and is caught
        call = json.loads(text)
        if text is bare and isinstance(call, dict) and set(call) not in ({"name", "parameters"}, {"name", "arguments"}):
            return None  # a JSON answer that happens to hold a "name", not Llama's call
        call = call[0] if isinstance(call, list) else call
        arguments = call.get("arguments", call.get("parameters", {}))
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        if not isinstance(call["name"], str) or not isinstance(arguments, dict):
            return None, {}
        return call["name"], arguments
    except Exception:  # not JSON, not a name and arguments
        return None, {}


class ChatFormat:
    """For a chat model: a call inside the assistant's turn, which ends with the end-of-turn token as every turn does;
    the answer comes back as a `tool` message of the model's chat template. The call is <calc>347 * 86</calc>, or, for a
    template that knows tools (`tools` given: it describes them to the model itself), the template's own format
    (read_json_call), which is checked here at start-up: a template that writes calls in a format this file does not
    read is refused in one line, instead of a run that never sees a call. The ids the environment appends are the text
    the template adds after the model's end-of-turn token: the rest of that turn's closing, the tool message, and the
    opening of the next assistant turn. A call is answered only in a turn that ends with that end-of-turn token, or
    with Llama 3.x's end of message <|eom_id|> where it is one of the model's EOS ids (`call_ends`: Meta's prompt format
    has the model end a call turn with it when the system message says "Environment: ipython", as Llama's template
    does whenever tools are given, while the template itself closes a call turn it renders with <|eot_id|> unless
    built-in tools are named); a turn that ends with another of the model's EOS ids (end of text) ends the conversation."""

    CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
    inline = False  # the verifier reads the model's last turn
    INSTRUCTION = (
        "You have a calculator. To use it, write <calc>EXPRESSION</calc>, for example <calc>12 * 34</calc>, and end your "
        "reply; its result comes back in the next message, and you continue from there."
    )

    def __init__(self, tokenizer, eos_ids: list[int], tools: list | None = None):
        self.tokenizer, self.eos_ids, self.tools, self.stop_ids = tokenizer, eos_ids, tools, []
        self.special = [t for t in tokenizer.added_tokens_decoder.values() if t.special]  # never inside a tool's answer
        turn, after_turn, self.end_of_turn = self.render("1 + 1", "2")
        if "2" not in after_turn:
            raise SystemExit(
                "the model's chat template does not end a turn with its end-of-turn token and then show a tool message"
            )
        end_of_message = tokenizer.get_vocab().get("<|eom_id|>")  # Llama 3.x's, one of its EOS ids (never unk's id)
        also_eom = [end_of_message] if end_of_message in eos_ids and end_of_message not in self.end_of_turn else []
        self.call_ends = self.end_of_turn + also_eom  # the ids after which a call is answered
        if self.find_call(turn) != ("calculator", {"expression": "1 + 1"}):  # (only a template's own format can fail)
            raise SystemExit(
                f"the model's chat template writes a tool call as {turn[:80]!r}, a format tools.py does not read (Qwen/Hermes "
                "<tool_call>, Llama 3.x JSON, Mistral [TOOL_CALLS]): use --tool-format inline, or add the format to "
                "tools.read_json_call"
            )

    def render(self, expression: str, result: str) -> tuple[str, str, list[int]]:
        """A call of the calculator and its answer, rendered by the chat template after a user turn: the model's turn
        (the call, without its end-of-turn token), the text after that token (tool message and next assistant turn's
        opening), and the end-of-turn token's id. The answer is shown as the template shows it (Llama's as JSON text:
        a `"` in it comes back escaped), so it is not looked for verbatim here: __init__ checks the probe's."""
        user = [{"role": "user", "content": "?"}]
        if self.tools:  # the template writes the call itself
            call = {"name": "calculator", "arguments": {"expression": expression}}
            calls = [{"type": "function", "id": PROBE_CALL_ID, "function": call}]
            assistant = {"role": "assistant", "content": "", "tool_calls": calls}
        else:
            assistant = {"role": "assistant", "content": f"<calc>{expression}</calc>"}
        tool = {"role": "tool", "content": result, "tool_call_id": PROBE_CALL_ID, "name": "calculator"}
        try:
            head = self.tokenizer.apply_chat_template(user, tools=self.tools, tokenize=False, add_generation_prompt=True)
            text = self.tokenizer.apply_chat_template(
                [*user, assistant, tool], tools=self.tools, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # e.g. a template that allows only user and assistant turns
            raise SystemExit(f"the model's chat template cannot render a tool message ({type(e).__name__}: {e})") from None
        ends = [(text.find(self.tokenizer.decode([i]), len(head)), i) for i in self.eos_ids]
        ends = sorted((at, i) for at, i in ends if at >= 0)
        if not text.startswith(head) or not ends:
            raise SystemExit(
                "the model's chat template does not end a turn with its end-of-turn token and then show a tool message"
            )
        at, end_id = ends[0]
        return text[len(head) : at], text[at + len(self.tokenizer.decode([end_id])) :], [end_id]

    def find_call(self, turn: str) -> tuple[str | None, dict] | None:
        """The call in this turn of the model, as (tool name, arguments); None: the model answered."""
        match = self.CALL.search(turn)
        if match is not None:
            return "calculator", {"expression": match.group(1).strip()}
        return read_json_call(turn)

    def call_text(self, expression: str) -> str:
        """The model's turn that calls the calculator on `expression`, as the template writes it (for demonstrations)."""
        return self.render(expression, "0")[0]

    def result_ids(self, result: str) -> list[int]:
        for token in self.special:  # a tool's answer cannot close the message or open a turn, whatever it echoes
            result = result.replace(token.content, "")
        return self.tokenizer(self.render("1 + 1", result)[1], add_special_tokens=False).input_ids


class InlineFormat:
    """A call is arithmetic followed by "=" in the model's reply; the answer is written right after it, in the same
    reply: "347 * 86 =" (the model) " 29842" (the calculator) ". So the answer is 29842." (the model). A turn stops at
    every token that ends with "="; when no arithmetic stands before it ("so x ="), the model simply goes on. The
    verifier reads the whole reply, the calculator's results included, as Toolformer's calls become part of the text."""

    INSTRUCTION = "Write each calculation as its numbers followed by =, like 12 * 34 =, and a calculator writes the result."
    CALL = re.compile(r"(\(*\d[\d.]*(?:\s*(?:\*\*|[-+*/×÷x])\s*\(*\d[\d.]*\)*)+)\s*=$")
    inline = True  # the calculator's results are part of the reply the verifier reads

    def __init__(self, tokenizer, eos_ids=()):
        self.tokenizer = tokenizer
        special = set(tokenizer.all_special_ids)
        self.stop_ids = [i for i in range(len(tokenizer)) if i not in special and tokenizer.decode([i]).endswith("=")]
        self.call_ends = self.stop_ids  # the ids after which a call is answered

    def find_call(self, turn: str) -> tuple[str, dict] | None:
        match = self.CALL.search(turn)
        return None if match is None else ("calculator", {"expression": match.group(1).replace("x", "*")})

    def result_ids(self, result: str) -> list[int]:
        return self.tokenizer(" " + result, add_special_tokens=False).input_ids


def template_renders_tools(tokenizer) -> bool:
    """Whether the chat template knows tools: it renders a prompt differently when given the calculator (a template
    that only mentions the word, or raises on tools, gets the <calc> format instead)."""
    user = [{"role": "user", "content": "?"}]
    render = lambda **tools: tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True, **tools)
    try:
        return render(tools=[calculator]) != render()
    except Exception:  # a template that cannot render tools
        return False


def format_and_prompts(args, task, tokenizer, eos_ids: list[int]):
    """The call format of --tool-format (auto: chat for a model with a chat template, else compact), and the task with
    its prompts rendered for it (tasks.apply_chat_template): the system message is --instruction (else the task's), then
    the format's INSTRUCTION, which tells the model how to call. A template that knows tools (one that renders `tools`,
    like Qwen2.5's or Llama 3.2's) gets the calculator itself instead, its JSON schema read by transformers from the
    function's docstring and type hints, and the model calls in the template's own format. Sets args.tool_format to the
    format chosen. Used by grpo_tools.py and sft_tools.py alike, so that the warm-up's prompts are RL's."""
    chat = args.chat_template != "none" and bool(tokenizer.chat_template)
    args.tool_format = {"auto": "chat" if chat else "compact"}.get(args.tool_format, args.tool_format)
    template_tools = [calculator] if args.tool_format == "chat" and template_renders_tools(tokenizer) else None
    if args.tool_format == "chat":
        tool_format = ChatFormat(tokenizer, eos_ids, template_tools)
    else:
        tool_format = {"compact": CompactFormat, "inline": InlineFormat}[args.tool_format](tokenizer, eos_ids)
    instruction = args.instruction or task.instruction or tasks.INSTRUCTIONS.get(task.name, "")
    how_to_call = "" if template_tools else getattr(tool_format, "INSTRUCTION", "")  # also after a conversation's own system
    return tool_format, tasks.apply_chat_template(
        task, tokenizer, args.chat_template, instruction, template_tools, how_to_call
    )
