"""Record and replay sampled rollouts, for the tests of several processes: patched in place of common.generate, so that
a run of one process can train on exactly the responses that the processes of a torchrun sampled."""

import os

import torch

import common
from plumbing import dist


def record_or_replay(folder: str):
    """A stand-in for common.generate. Its n-th sampled call (temperature > 0; greedy evaluation passes through) on rank
    r saves the rollout to FOLDER/n-rank{r}.pt, or reads it back from there if that file exists (the same rollouts
    again, e.g. under FSDP2 after DDP). A single process that finds the files of a run of several processes replays the
    union of the ranks' rollouts, in rank order, for exactly the same prompts: then its update should equal theirs."""
    generate, calls = common.generate, [0]

    def record_or_replay_generate(
        model, tokenizer, prompt_ids, prompt_mask, max_new_tokens: int, temperature: float, *more, return_logprobs=False
    ):
        if temperature == 0:  # (more: grpo_tools.py's stop ids and finished rows)
            return generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature, *more)
        call, calls[0] = calls[0], calls[0] + 1
        prompts = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask)]
        files = sorted(f for f in os.listdir(folder) if f.startswith(f"{call:04d}-rank")) if os.path.isdir(folder) else []
        this_rank = os.path.join(folder, f"{call:04d}-rank{dist.rank()}.pt")
        if dist.world_size() == 1 and len(files) > 1:
            saved = [torch.load(os.path.join(folder, f"{call:04d}-rank{r}.pt")) for r in range(len(files))]
        elif os.path.isfile(this_rank):
            saved = [torch.load(this_rank)]
        else:
            # (return_logprobs: grpo_engine.py's engine, whose sampling log-probs are part of the rollout)
            rollout = generate(
                model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature, *more, return_logprobs=return_logprobs
            )
            os.makedirs(folder, exist_ok=True)
            torch.save({"prompts": prompts, "rollout": [x.cpu() for x in rollout]}, this_rank)
            return rollout
        if [p for s in saved for p in s["prompts"]] != prompts:
            raise ValueError(f"the rollouts saved in {folder} (call {call}) are for other prompts")
        pads = (tokenizer.pad_token_id, False, False, 0.0)[: len(saved[0]["rollout"])]
        return tuple(
            common.cat_padded([s["rollout"][i] for s in saved], pad).to(prompt_ids.device) for i, pad in enumerate(pads)
        )

    return record_or_replay_generate
