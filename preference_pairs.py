"""Preference pairs (prompt, chosen, rejected) for dpo.py and reward_model.py: built from the policy's own answers and
judged by the task's verifier (built once and cached, so that both scripts train on the same pairs), or read from a
user's file with --dataset."""

import hashlib
import json
import os
import random
import time
from collections import Counter
from collections.abc import Callable

import torch

import common
import tasks
from plumbing import dist, lora, models


@torch.no_grad()
def sample_verifier_pairs(policy, tokenizer, task: tasks.Task, args, device: torch.device):
    """Pairs (prompt, chosen, rejected) from the policy's own answers, judged by the task's verifier: each of
    args.num_pair_prompts training problems is answered args.group_size times at temperature 1, and the most frequent
    correct answer is paired with the most frequent wrong one (problems without both are skipped and counted). Each
    answer keeps the id of the end token it was sampled with (chosen_end, rejected_end): a chat model may end its turn
    with another token than the tokenizer's EOS. Returns (datasets.Dataset, skipped)."""
    import datasets
    from tqdm import tqdm

    rng = random.Random(0)  # the same pairs for every seed
    prompts_all = task.train[rng.sample(range(len(task.train)), min(args.num_pair_prompts, len(task.train)))]
    pairs, skipped = {"prompt": [], "chosen": [], "rejected": [], "chosen_end": [], "rejected_end": []}, 0
    for start in tqdm(range(0, len(prompts_all["prompt"]), 64), desc="building pairs"):
        prompts, answers = prompts_all["prompt"][start : start + 64], prompts_all["answer"][start : start + 64]
        prompt_ids, prompt_mask = common.tokenize_prompts(
            tokenizer, [p for p in prompts for _ in range(args.group_size)], device
        )
        completion_ids, mask, truncated = common.generate(policy, tokenizer, prompt_ids, prompt_mask, args.max_new_tokens, 1.0)
        texts = common.decode(tokenizer, completion_ids, mask, truncated)
        ends = completion_ids.gather(1, mask.sum(dim=1, keepdim=True) - 1).squeeze(1).tolist()  # (B,) the last valid id
        correct = task.verify(texts, [a for a in answers for _ in range(args.group_size)])  # (B,)
        ended = ~truncated  # only answers that ended with EOS
        for i, prompt in enumerate(prompts):
            group = range(i * args.group_size, (i + 1) * args.group_size)
            good = Counter((texts[j], ends[j]) for j in group if correct[j] == 1 and ended[j])
            bad = Counter((texts[j], ends[j]) for j in group if correct[j] == 0 and ended[j])
            if not good or not bad:
                skipped += 1
                continue
            # the most frequent correct and wrong answers: the policy's likeliest success against its likeliest mistake
            (chosen, chosen_end), (rejected, rejected_end) = good.most_common(1)[0][0], bad.most_common(1)[0][0]
            for key, value in zip(pairs, (prompt, chosen, rejected, chosen_end, rejected_end)):
                pairs[key].append(value)
    return datasets.Dataset.from_dict(pairs), skipped


def cached_verifier_pairs(args, task: tasks.Task, load_policy: Callable, device: torch.device):
    """The built-in preference pairs of args.model_name_or_path on args.task (sample_verifier_pairs), built the first
    time and cached, so that dpo.py and reward_model.py train on the same pairs and build them once. `load_policy()`
    returns (policy, tokenizer) in the policy's own dtype (lora.base_dtype, part of the cache key) and is called only when
    the pairs must be built. Returns (pairs, skipped, seconds spent building them: 0 from the cache)."""
    import datasets

    model_path = models.resolve_model_path(args.model_name_or_path, args.cache_dir, args.task)
    recipe = ["most-frequent-v2", os.path.abspath(model_path), args.task, args.num_pair_prompts, args.group_size]
    recipe += [args.max_new_tokens] + ([task.train[0]["prompt"]] if task.chat else [])  # prompts rendered how
    recipe += [str(lora.base_dtype(args, device))]  # sampled by the policy in its own dtype: a bf16 base samples others
    key = hashlib.sha1(json.dumps(recipe).encode()).hexdigest()[:10]
    pairs_dir = os.path.join(models.cache_root(args.cache_dir), f"dpo-pairs-{key}")
    # under torchrun rank 0 builds them (alone) while the others wait: every rank must take the same decision
    missing, start = not dist.true_on_every_rank(os.path.isdir(pairs_dir)), time.time()
    if missing and dist.is_main():
        with torch.random.fork_rng(devices=[]), dist.as_single_process():  # the same pairs for every --seed: one cache
            policy, tokenizer = load_policy()  # (a warm-up it may start runs on this rank alone, like the pairs)
            torch.manual_seed(0)
            pairs, skipped = sample_verifier_pairs(policy, tokenizer, task, args, device)
        partial = f"{pairs_dir}.partial-{os.getpid()}"
        pairs.save_to_disk(partial)
        with open(os.path.join(partial, "skipped.json"), "w") as f:
            json.dump(skipped, f)
        models.move_into_place(partial, pairs_dir)  # only complete pairs ever sit at pairs_dir
    dist.wait_for_file(pairs_dir)
    with open(os.path.join(pairs_dir, "skipped.json")) as f:
        skipped = json.load(f)
    return datasets.load_from_disk(pairs_dir), skipped, time.time() - start if missing else 0.0


def split_held_out(pairs, num_eval: int):
    """(train, held_out) of a user's pairs: `num_eval` of them (at most half) held out for evaluation, split by prompt,
    so that no prompt is both trained on and evaluated; the split is fixed (its own seed)."""
    if len(set(pairs["prompt"])) < 2:
        raise SystemExit("--dataset: needs pairs of at least two distinct prompts (one to train on, one held out)")
    return tasks.split_by_key(pairs, min(num_eval, len(pairs) // 2), lambda row: row["prompt"], seed=1234)


def load_pairs(path: str):
    """--dataset of preference pairs (dpo.py, reward_model.py): like tasks.load_user_dataset, with prompt, chosen and rejected
    columns, the prompts as plain text (see render_prompts)."""
    return tasks.load_user_dataset(path, "--dataset", ("prompt", "chosen", "rejected"))


def load_labelled(path: str):
    """--dataset of labelled examples (kto.py): like load_pairs, with prompt, completion and label columns, the label
    true (desirable) or false (undesirable), or 1 / 0; any other label is refused in one line."""
    examples = tasks.load_user_dataset(path, "--dataset", ("prompt", "completion", "label"))
    for value in examples["label"]:
        if value not in (True, False):  # 1 and 0 compare equal to them; "yes", None and 2 do not
            raise SystemExit(f"--dataset {path!r}: a label is {value!r}; labels must be true or false (or 1 or 0)")
    return examples


def render_prompts(pairs, tokenizer, args) -> tasks.Task:
    """A task whose `train` holds a user's pairs, their prompts rendered as the RL scripts render a user's prompts
    (tasks.apply_chat_template: --chat-template, and --instruction or the --task's answer format as the system message);
    chosen and rejected are the assistant's turn that follows. A prompt already rendered by its author is refused in one
    line (by tasks.apply_chat_template, as for the RL scripts), unless --chat-template none."""
    task = tasks.Task(args.task, pairs, pairs.select([]), *tasks.verifier(args.task))
    return tasks.apply_chat_template(task, tokenizer, args.chat_template, args.instruction)  # .train: the pairs


def tokenize_pairs(tokenizer, pairs, device: torch.device, keys=("chosen", "rejected")) -> dict:
    """Left-padded prompts and right-padded chosen / rejected completions, each followed by the end token it was sampled
    with (the chosen_end and rejected_end columns of built-in pairs; the tokenizer's EOS for a user's pairs): a dict of
    (N, L) tensors prompt_ids, prompt_mask, chosen_ids, chosen_mask, rejected_ids, rejected_mask. kto.py's unpaired
    examples pass keys=("completion",): completion_ids, completion_mask."""
    prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, pairs["prompt"], device)
    data = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask}
    for key in keys:
        ends = pairs.get(f"{key}_end") or [tokenizer.eos_token_id] * len(pairs[key])
        ids = [tokenizer(text, add_special_tokens=False).input_ids + [end] for text, end in zip(pairs[key], ends)]
        width = max(len(i) for i in ids)
        data[f"{key}_ids"] = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i in ids], device=device)
        data[f"{key}_mask"] = torch.tensor([[True] * len(i) + [False] * (width - len(i)) for i in ids], device=device)
    return data
