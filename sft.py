"""Supervised warm-up of the built-in tiny model: the starting policy (and the frozen reference) of every RL script.

A fresh tiny Llama is trained with next-token cross-entropy on "prompt + answer + EOS" from the built-in task's
training split, the loss taken on the answer tokens only. It is stopped early on purpose, as soon as it answers about
half of a slice of the training problems correctly, which leaves room for RL to show. The RL scripts call `warm_up`
the first time they need the built-in model and cache the result; you can also run it yourself:

    python sft.py --output-dir runs/sft
"""

import os
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import tyro
from tqdm import tqdm

import common


@dataclass
class Args:
    output_dir: str = "runs/sft"
    """where the model and tokenizer are saved"""
    seed: int = 0
    """seed of the warm-up (fixed, so that every RL run starts from the same policy)"""
    device: str = "auto"
    """auto (CUDA when available), cpu or cuda"""
    max_steps: int = 1500
    """optimizer steps at most"""
    target_accuracy: float = 0.5
    """stop as soon as greedy accuracy on 500 training problems reaches this (checked every 25 steps)"""
    batch_size: int = 64
    """problems per step"""
    learning_rate: float = 1e-3
    """AdamW learning rate (linear warm-up over the first 50 steps, then constant)"""
    max_new_tokens: int = 8
    """generation budget of the accuracy checks"""


def warm_up(args: Args) -> dict:
    common.seed_everything(args.seed)
    device = common.get_device(args.device)
    task = common.make_task("addition")
    tokenizer = common.build_tokenizer()
    model = common.build_tiny_model(tokenizer).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50))
    rng = random.Random(args.seed)
    check_set = task.train.select(range(500))
    start, accuracy = time.time(), 0.0
    for step in (bar := tqdm(range(1, args.max_steps + 1), desc="sft warm-up")):
        batch = task.train[rng.sample(range(len(task.train)), args.batch_size)]
        answers = [a + tokenizer.eos_token for a in batch["answer"]]
        input_ids, attention_mask = common.tokenize_prompts(
            tokenizer, [p + a for p, a in zip(batch["prompt"], answers)], device
        )
        answer_len = torch.tensor([len(tokenizer(a, add_special_tokens=False).input_ids) for a in answers], device=device)
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        with common.autocast(device):
            logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        # left padding puts each answer in the last answer_len positions; position t predicts token t + 1
        is_answer = torch.arange(input_ids.shape[1], device=device) >= input_ids.shape[1] - answer_len[:, None]  # (B, L)
        loss = F.cross_entropy(logits[:, :-1][is_answer[:, 1:]].float(), input_ids[:, 1:][is_answer[:, 1:]])
        common.check_finite(loss, "warm-up loss", step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 25 == 0:
            accuracy = common.evaluate(model, tokenizer, task, args.max_new_tokens, dataset=check_set)["eval/accuracy"]
            if accuracy >= args.target_accuracy:
                break
        bar.set_postfix(loss=f"{loss.item():.3f}", train_accuracy=f"{accuracy:.2f}")
    metrics = common.evaluate(model, tokenizer, task, args.max_new_tokens)
    print(f"warm-up: {step} steps, {time.time() - start:.0f}s, greedy held-out accuracy {metrics['eval/accuracy']:.1%}")
    os.makedirs(args.output_dir, exist_ok=True)
    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    return metrics


if __name__ == "__main__":
    warm_up(tyro.cli(Args))
