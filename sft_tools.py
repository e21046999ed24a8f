"""Supervised warm-up of a chat model on tool-use demonstrations: the starting policy of grpo_tools.py in the chat format.

RL reinforces what a policy already does now and then. A chat model that never writes a call gives it nothing to
reinforce: told about <calc>EXPRESSION</calc> in its system message, SmolLM2-135M-Instruct wrote the tag 0 times in 64
samples (docs/tools.md). Agent recipes therefore start with a short supervised warm-up on demonstrations of tool use,
then RL (Toolformer, Schick et al. 2023, fine-tunes on calls that helped; ReTool, Feng et al. 2025, a "cold start" on
code-interpreter traces before RL). This script writes its demonstrations itself, for the training problems of --task
products ("What is 347 * 86?"), and trains on them:

- A demonstration is a whole conversation after its prompt, built in ids exactly as grpo_tools.py's rollout builds one:
  the prompt rendered by tools.format_and_prompts (the same system message and chat template as in RL), the model's
  call turn as the format writes it (tools.ChatFormat.call_text: <calc>347 * 86</calc>, or a template's own format)
  with its end-of-turn token, the calculator's real answer as the template's tool message (tools.ChatFormat.result_ids),
  then the model's last turn, "347 * 86 = 29842", and its end-of-turn token.
- Only --tool-share of the demonstrations (drawn at random) call the calculator; the others state the product outright,
  which a small model cannot compute. So the warm-up leaves a policy that calls now and then and guesses otherwise, as
  the built-in multiplication model's warm-up does (sft.py), and RL has something to find: that calling pays.
- The loss is next-token cross-entropy on the ids the model would write, its turns and their end-of-turn tokens; the
  tool message is context, never a target, as in RL (a model trained to predict the calculator's answers learns to forge
  them: docs/tools.md).

    python sft_tools.py --model-name-or-path MODEL_DIR       # MODEL_DIR: python -m benchmarks.prepare_smollm2 prints it
    python grpo_tools.py --model-name-or-path runs/sft_tools__1/model --task products --tool-format chat

The warm-up runs in one process, on the GPU when there is one. grpo_tools.py's first evaluation (step 0) is the
warm-up's held-out accuracy and call rate.
"""

import os
import random
import re
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import tyro
from tqdm import tqdm

import common
import tasks
import tools
from plumbing import checks, dist, models, run_state


@dataclass
class Args:
    model_name_or_path: str
    """the chat model to warm up: a local folder (e.g. benchmarks/prepare_smollm2.py's) or a hub id"""
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the script's name)"""
    seed: int = 1
    """seed of the demonstrations drawn, of which call the tool, and of the batches"""
    device: str = "auto"
    """auto (CUDA when available), cpu or cuda"""
    output_dir: str = ""
    """where the warmed-up model and tokenizer go, in OUTPUT_DIR/model (default: runs/EXP_NAME__SEED)"""
    chat_template: str = "auto"
    """auto or on: the prompts rendered with the model's chat template, as grpo_tools.py renders them (a template is
    needed: a tool message is a chat turn)"""
    instruction: str = ""
    """the system message, as grpo_tools.py's --instruction (default: the task's, then tools.ChatFormat.INSTRUCTION)"""
    tool_share: float = 0.5
    """the share of demonstrations that call the calculator; the others state the product outright"""
    num_steps: int = 30
    """optimizer steps"""
    batch_size: int = 16
    """demonstrations per step (each a fresh training problem)"""
    learning_rate: float = 2e-5
    """AdamW learning rate (linear warm-up over the first 5 steps, then constant)"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold"""

    def __post_init__(self):
        self.output_dir = self.output_dir or f"runs/{self.exp_name}__{self.seed}"
        self.task, self.tool_format = "products", "chat"  # what the demonstrations are written for (grpo_tools.py's flags)


def check_args(args: Args) -> None:
    """Fail fast with the flag's name, before any expensive work."""
    checks.model_task_and_device(args)
    if dist.world_size() > 1:
        raise SystemExit("sft_tools.py runs in one process: start it with python, not torchrun")
    checks.flag(
        args, "chat_template", "allowed values are auto and on (a tool message is a chat turn)", lambda v: v in ("auto", "on")
    )
    checks.flag(args, "tool_share", "must be in [0, 1]", lambda v: 0 <= v <= 1)
    for flag in ("num_steps", "batch_size"):
        checks.flag(args, flag, "must be at least 1", lambda v: v >= 1)
    checks.flag(args, "learning_rate", "must be positive", lambda v: v > 0)
    checks.flag(args, "max_grad_norm", "must be positive", lambda v: v > 0)
    checks.writable_dir("--output-dir", args.output_dir)


def demonstration(tokenizer, tool_format: tools.ChatFormat, a: int, b: int, call: bool) -> tuple[list[int], list[bool]]:
    """The ids of one conversation after its prompt, and which of them the model writes (the loss's targets): with
    `call`, the call turn, the tool message with the calculator's answer, and the last turn; else the last turn alone."""
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    expression = f"{a} * {b}"
    last_turn = encode(f"{expression} = {a * b}") + tool_format.end_of_turn  # ended by the template's end-of-turn token
    if not call:
        return last_turn, [True] * len(last_turn)
    call_turn = encode(tool_format.call_text(expression)) + tool_format.end_of_turn
    result, _ = tools.run_tool(tools.TOOLS, "calculator", {"expression": expression})
    answer = tool_format.result_ids(result)  # written by the environment: context, not a target
    return call_turn + answer + last_turn, [True] * len(call_turn) + [False] * len(answer) + [True] * len(last_turn)


if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args)
    device = dist.init_device(args.device)
    common.seed_everything(args.seed)
    policy, tokenizer = models.load_model_and_tokenizer(args.model_name_or_path, "", device, args.task)
    if not tokenizer.chat_template:
        raise SystemExit(f"--model-name-or-path {args.model_name_or_path}: the tokenizer has no chat template")
    raw = tasks.make_task(args.task)
    # the prompts and the call format exactly as grpo_tools.py makes them (its --tool-format chat)
    tool_format, task = tools.format_and_prompts(args, raw, tokenizer, common.eos_token_ids(policy, tokenizer))
    operands = [tuple(int(n) for n in re.findall(r"\d+", p)) for p in raw.train["prompt"]]  # "What is 347 * 86?"
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=0.0)
    rng = random.Random(args.seed)
    logger = run_state.MetricsLogger(args.output_dir, None, common.pool_metrics)  # OUTPUT_DIR/metrics.jsonl
    start, calls = time.time(), 0
    bar = tqdm(range(1, args.num_steps + 1), args.exp_name)
    for step in bar:
        # a batch of demonstrations: the rendered prompt, then the conversation; targets on the model's ids only
        rows = rng.sample(range(len(task.train)), args.batch_size)
        sequences, targets = [], []
        for row in rows:
            prompt = tokenizer(task.train[row]["prompt"], add_special_tokens=False).input_ids
            call = rng.random() < args.tool_share
            ids, is_target = demonstration(tokenizer, tool_format, *operands[row], call)
            sequences.append(torch.tensor(prompt + ids))
            targets.append(torch.tensor([False] * len(prompt) + is_target))
            calls += call
        input_ids = common.cat_padded([s[None] for s in sequences], tokenizer.pad_token_id).to(device)  # (B, L)
        attention_mask = common.cat_padded([torch.ones(1, len(s), dtype=torch.long) for s in sequences], 0).to(device)
        is_target = common.cat_padded([t[None] for t in targets], False).to(device)  # (B, L)
        with common.autocast(device):
            logits = policy(input_ids, attention_mask=attention_mask, use_cache=False).logits  # (B, L, V)
        # position t predicts id t + 1: the mean cross-entropy over every target id of the batch
        loss = F.cross_entropy(logits[:, :-1][is_target[:, 1:]].float(), input_ids[:, 1:][is_target[:, 1:]])
        common.check_finite(loss, "warm-up loss", step)
        optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
        for group in optimizer.param_groups:  # linear warm-up over 5 steps, then constant
            group["lr"] = args.learning_rate * min(1.0, step / 5)
        optimizer.step()
        logger.log(step, {"sft/loss": loss.detach(), "train/grad_norm": grad_norm, "sft/demonstrations_calling": calls})
        bar.set_postfix(loss=f"{loss.item():.3f}", grad_norm=f"{grad_norm.item():.2f}")

    dist.save_model(policy, tokenizer, os.path.join(args.output_dir, "model"))
    logger.close()
    print(
        f"warm-up: {args.num_steps} steps of {args.batch_size} demonstrations ({calls} calling the calculator) in "
        f"{time.time() - start:.0f}s, last loss {loss.item():.3f}; saved to {os.path.join(args.output_dir, 'model')}"
    )
