"""Supervised warm-up of the built-in tiny model: the starting policy (and the frozen reference) of every RL script.

A fresh tiny Llama is trained with next-token cross-entropy on "prompt + answer + EOS" from the built-in task's
training split, the loss taken on the answer tokens only. It is stopped early on purpose, as soon as it answers half
of a check set correctly, which leaves room for RL to show. The check set is split off the training split (by the
unordered pair of operands, like the held-out split) and never trained on here, so that its accuracy estimates the
held-out accuracy; it is checked every few steps, so that where the warm-up stops does not hinge on the small
floating-point differences between two machines. The RL scripts run this file (plumbing/models.py's warm_up_command) the
first time they need the built-in model and cache the result (with warm_up.json: the steps, the check and held-out
accuracy, the seconds it took); you can also run it yourself:

    python sft.py --output-dir runs/sft
    torchrun --standalone --nproc-per-node 2 sft.py --output-dir runs/sft   # data parallel: each process takes half a batch
"""

import copy
import json
import os
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import tyro
from tqdm import tqdm

import common
import tasks
from plumbing import checks, dist


@dataclass
class Args:
    output_dir: str = "runs/sft"
    """where the model and tokenizer are saved"""
    task: str = "addition"
    """the built-in task to warm up on: addition, scratchpad or multiplication (the flags of each built-in model's
    warm-up are plumbing/models.py's WARM_UP_FLAGS; on multiplication the held-out accuracy printed at the end is that of
    answers without a tool)"""
    seed: int = 0
    """seed of the warm-up (fixed, so that every RL run starts from the same policy)"""
    device: str = "auto"
    """auto (CUDA when available), cpu or cuda"""
    max_steps: int = 1500
    """optimizer steps at most"""
    target_accuracy: float = 0.52
    """stop at the first check whose greedy accuracy on the check set is within `tolerance` of this"""
    tolerance: float = 0.03
    """half-width of the band of check accuracies that stops the warm-up"""
    approach_accuracy: float = 0.3
    """from this check accuracy on, the check runs after every step: near the target, one step moves the accuracy by
    up to 20 points, back and forth, so that only a check after every step finds a state inside the band"""
    check_every: int = 10
    """steps between two accuracy checks before approach_accuracy is reached"""
    num_check: int = 1000
    """problems in the check set, split off the training split and not trained on during the warm-up"""
    batch_size: int = 64
    """problems per step"""
    learning_rate: float = 1e-3
    """AdamW learning rate (linear warm-up over the first 50 steps, then constant; a lower rate near the target makes
    the accuracy climb smoothly but leaves a starting policy from which RL learns far more slowly)"""
    max_new_tokens: int = 0
    """generation budget of the held-out evaluation at the end (0: the task's)"""
    max_positions: int = 64
    """max_position_embeddings of the tiny model's config: prompt and response must fit"""


# ---------------------------------------------------------------------------------------------------------------------
# The built-in tiny model: a Llama-architecture causal LM with a character-level tokenizer, saved as an ordinary
# Hugging Face model so that it loads through AutoModelForCausalLM / AutoTokenizer exactly like a hub model.
# ---------------------------------------------------------------------------------------------------------------------

CHARS = "0123456789+-*= "
TOOL_CHARS = "<>[]()/.:abcdefghijklmnopqrstuvwxyz"  # the multiplication task's extra characters: calls, tool answers


def build_tokenizer(extra_chars: str = ""):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *CHARS, *extra_chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def build_tiny_model(tokenizer, max_positions: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def check_args(args: Args) -> None:
    """Fail fast with the flag's name, before any expensive work."""
    checks.device(args)
    checks.distributed_flags(args, "batch_size")
    checks.flag(args, "task", f"allowed values are {', '.join(tasks.BUILTIN_TASKS)}", lambda v: v in tasks.BUILTIN_TASKS)
    for flag in ("max_steps", "check_every", "num_check", "batch_size", "max_positions"):
        checks.flag(args, flag, "must be at least 1", lambda v: v >= 1)
    checks.flag(args, "max_new_tokens", "must be 0 (the task's) or positive", lambda v: v >= 0)
    checks.flag(args, "num_check", "must leave problems to train on (at most 5000)", lambda v: v <= 5000)
    checks.flag(args, "learning_rate", "must be positive", lambda v: v > 0)
    checks.flag(args, "target_accuracy", "must be in (0, 1]", lambda v: 0 < v <= 1)
    checks.flag(args, "tolerance", "must be 0 or positive", lambda v: v >= 0)
    checks.flag(args, "approach_accuracy", "must be in [0, 1]", lambda v: 0 <= v <= 1)
    checks.writable_dir("--output-dir", args.output_dir)


def written_by_environment(text: str) -> list[bool]:
    """For each character of `text` (a token of the built-in tokenizer): whether it lies in a tool's answer "[...]",
    brackets included: text that the environment writes in a rollout, and that the warm-up does not train on either."""
    inside, marks = False, []
    for c in text:
        inside = inside or c == "["
        marks.append(inside)
        inside = inside and c != "]"
    return marks


def encode(tokenizer, batch: dict, device: torch.device):
    """ "prompt + solution + EOS", left-padded: input_ids, attention_mask, position_ids and is_answer, all (B, L), where
    is_answer marks the solution's tokens and its EOS (the last answer_len positions of each row) but a tool's answers. The
    solution is the answer itself on the addition task, the worked columns and the answer on the scratchpad task, and on
    the multiplication task the product or a call, the tool's answer and the product."""
    answers = [a + tokenizer.eos_token for a in batch["solution"]]
    input_ids, attention_mask = common.tokenize_prompts(tokenizer, [p + a for p, a in zip(batch["prompt"], answers)], device)
    answer_len = torch.tensor([len(tokenizer(a, add_special_tokens=False).input_ids) for a in answers], device=device)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    is_answer = torch.arange(input_ids.shape[1], device=device) >= input_ids.shape[1] - answer_len[:, None]  # (B, L)
    # multiplication: a tool's answer "[...]" in a solution is the environment's text, never trained on (grpo_tools.py)
    by_environment = [written_by_environment(p + s) + [False] for p, s in zip(batch["prompt"], batch["solution"])]  # + EOS
    is_answer &= ~common.cat_padded([torch.tensor([row]) for row in by_environment], False, left=True).to(device)
    return input_ids, attention_mask, position_ids, is_answer


@torch.no_grad()
def greedy_accuracy(model, tokenizer, dataset, batch_size: int = 1000) -> float:
    """Fraction of problems whose answer and EOS are, token by token, the model's argmax given the true prefix: those
    are the problems that greedy decoding answers exactly, found with one forward pass instead of one per generated
    token. (The verifier also accepts an answer padded with spaces, which this misses.)"""
    device = next(model.parameters()).device
    correct = []
    for start in range(0, len(dataset), batch_size):
        input_ids, attention_mask, position_ids, is_answer = encode(tokenizer, dataset[start : start + batch_size], device)
        with common.autocast(device):
            logits = model(input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).logits
        hit = (logits[:, :-1].argmax(dim=-1) == input_ids[:, 1:]) | ~is_answer[:, 1:]  # position t predicts token t + 1
        correct.append(hit.all(dim=1))
    return torch.cat(correct).float().mean().item()


def warm_up(args: Args) -> dict:
    device = dist.init_device(args.device)
    common.seed_everything(args.seed)
    task = tasks.make_task(args.task)
    tokenizer = build_tokenizer(TOOL_CHARS if args.task == "multiplication" else "")
    model = build_tiny_model(tokenizer, args.max_positions).to(device)
    (model,) = dist.prepare_models(args, model)  # under torchrun: rank 0's initial weights on every rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    rng = random.Random(args.seed)
    train_set, check_set = tasks.split_by_key(task.train, args.num_check, tasks.addition_operands, seed=args.seed)
    checks.flag(args, "batch_size", f"at most the {len(train_set)} training problems", lambda v: v <= len(train_set))
    start, accuracy, approaching = time.time(), 0.0, False
    closest = (float("inf"), None, 0, 0.0)  # (distance to the target, weights, step, accuracy) of the closest check
    bar = tqdm(range(1, args.max_steps + 1), desc="sft warm-up", disable=not dist.is_main())
    for step in bar:
        batch = train_set[dist.shard(rng.sample(range(len(train_set)), args.batch_size))]  # torchrun: this rank's share
        input_ids, attention_mask, position_ids, is_answer = encode(tokenizer, batch, device)
        with common.autocast(device):
            kw = {"attention_mask": attention_mask, "position_ids": position_ids, "use_cache": False}
            logits = model(input_ids, **kw).logits
        # the loss on the answer's tokens and EOS only; position t predicts token t + 1. Under torchrun, the mean over
        # every rank's answer tokens (the factor is exactly 1 in one process)
        num_tokens = is_answer[:, 1:].sum()
        loss = F.cross_entropy(logits[:, :-1][is_answer[:, 1:]].float(), input_ids[:, 1:][is_answer[:, 1:]])
        loss = loss * (num_tokens / dist.mean_over_ranks(num_tokens))
        common.check_finite(loss, "warm-up loss", step)
        optimizer.zero_grad()
        loss.backward()
        dist.average_gradients(optimizer)  # under torchrun: the mean of every rank's gradient
        for group in optimizer.param_groups:  # linear warm-up over 50 steps, then constant
            group["lr"] = args.learning_rate * min(1.0, step / 50)
        optimizer.step()
        if approaching or step % args.check_every == 0 or step == args.max_steps:  # a last check: some state is kept
            accuracy = greedy_accuracy(model, tokenizer, check_set)  # under torchrun: every rank agrees on it
            accuracy = dist.mean_over_ranks(torch.tensor(accuracy, dtype=torch.float64)).item()
            if abs(accuracy - args.target_accuracy) < closest[0]:
                closest = (abs(accuracy - args.target_accuracy), copy.deepcopy(model.state_dict()), step, accuracy)
            if abs(accuracy - args.target_accuracy) <= args.tolerance:
                break
            approaching = approaching or accuracy >= args.approach_accuracy
        bar.set_postfix(loss=f"{loss.item():.3f}", check_accuracy=f"{accuracy:.2f}")
    else:  # never inside the band: keep the checked state closest to the target
        print(f"warm-up: no check within {args.tolerance} of {args.target_accuracy}; keeping the closest (step {closest[2]})")
    _, weights, step, accuracy = closest
    model.load_state_dict(weights)
    metrics = common.evaluate(model, tokenizer, task, args.max_new_tokens or task.max_new_tokens)
    metrics.update({"sft/steps": step, "sft/check_accuracy": accuracy, "time/warm_up": time.time() - start})
    print(
        f"warm-up: {step} steps, {metrics['time/warm_up']:.0f}s, greedy accuracy {accuracy:.1%} on the check set, "
        f"{metrics['eval/accuracy']:.1%} held out"
    )
    dist.save_model(model, tokenizer, args.output_dir)  # under torchrun: rank 0
    if dist.is_main():  # beside the model: what the warm-up reached, and in how long
        with open(os.path.join(args.output_dir, "warm_up.json"), "w") as f:
            json.dump({k: v for k, v in metrics.items() if k != "samples"}, f, indent=1)
    return metrics


if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args)
    warm_up(args)
