"""GRPO with tool calls: grpo.py's algorithm on conversations of several turns, in which the model calls a calculator.

A rollout is a conversation: the model writes a turn, which ends at EOS or at a tool call; the environment runs the
tool and appends its answer as tokens; the model writes the next turn, up to --max-turns turns and --max-new-tokens
tokens in all. One verifier reward scores the model's last turn, and GRPO's group advantage, clipped surrogate and k3
penalty are computed exactly as in grpo.py, with one change: the loss is taken only on the tokens the model sampled.
The environment's tokens are in the context the model reads (the attention mask) but not in the loss mask: no policy
gradient, no KL, no entropy, and they count in no per-token mean. They were not sampled from the policy, so they have
no place in a policy gradient (see docs/tools.md for what happens when they are trained on). The conversation is kept
as token ids from start to end and never re-tokenized from text, which would shift token boundaries, so that the
log-probs scored are those of the ids that were sampled. This is the multi-turn form of GRPO used for tool-using
agents (Toolformer, Schick et al. 2023, for calls inside the text; DeepSeek-R1-style RL on top, e.g. ReTool, Feng et
al. 2025; SkyRL and verl's multi-turn rollouts mask the environment's tokens the same way).

    python grpo_tools.py

Departures from the paper:
1. The reward is a verifier (1 correct, 0 wrong) of the model's last turn unless --reward-model or --reward-funcs say, and
   the reference model is the warm-up policy, never reset.
2. The group std is the population std (divide by G); most libraries use the sample std (G - 1).
3. A group whose rewards are all equal gets an advantage of exactly 0 (never NaN).
4. The gradient of the k3 penalty estimates the gradient of KL(pi_ref || pi), not of KL(pi || pi_ref): see compute_loss.
5. Each rollout batch is split into num_minibatches minibatches, one AdamW step each, for num_epochs passes (the
   paper's mu); gradients are clipped.
6. TOOLS: every change against grpo.py is tagged so; tools.py holds the calculator and the three call formats.
"""

import math
import os
import random
import time
from dataclasses import dataclass

import torch
import tyro
from tqdm import tqdm

import common
import reward_funcs
import tasks
import tools
from plumbing import checks, dist, lora, models, run_state

TOTAL_STEPS = 40  # default --total-steps  # TOOLS: the model finds the calculator within a few dozen steps


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the script's name)"""
    seed: int = 1
    """seed of prompt sampling, generation and minibatch order"""
    device: str = "auto"
    """auto (CUDA when available), cpu or cuda"""
    model_name_or_path: str = "builtin"
    """'builtin' (the tiny model after its cached warm-up, see sft.py), a local folder, or a hub id"""
    cache_dir: str = ""
    """where the built-in model is cached (default: $TINY_RLHF_CACHE or ~/.cache/tiny-rlhf)"""
    task: str = "multiplication"
    """TOOLS: 'multiplication' (offline, for the built-in model), 'products' (offline, for a chat model), or with a chat
    model any task of grpo.py"""
    dataset: str = ""
    """your own prompts instead of the task's: a .json/.jsonl/.csv/.parquet file, a save_to_disk folder or a hub id with
    prompt and answer columns (text or conversations), scored by --task's verifier; every column reaches --reward-funcs"""
    prompt_column: str = "prompt"
    """with --dataset: the column of the prompts, text or conversations (lists of {"role", "content"} messages)"""
    answer_column: str = "answer"
    """with --dataset: the column of the reference answers, which --task's verifier checks"""
    num_eval: int = 500
    """with --dataset: prompts held out for evaluation (at most half of them; split by prompt, never trained on)"""
    chat_template: str = "auto"
    """auto: prompts rendered with the tokenizer's chat template when it has one (the task's answer format as the
    system message); none: plain prompts; on: like auto, but a template is required"""
    instruction: str = ""
    """the system message a chat model gets with each prompt: the answer format (default: the task's own, e.g. for
    --dataset prompts scored like gsm8k, "Solve the problem step by step. End your reply with ... a plain number."),
    then (TOOLS) the calculator's description, tools.ChatFormat.INSTRUCTION"""
    output_dir: str = ""
    """where metrics.jsonl and the final model go (default: runs/EXP_NAME__SEED)"""
    eval_every: int = 20
    """evaluate greedy held-out accuracy every this many steps (and before the first and after the last)"""
    eval_samples: int = 0
    """with N > 0, each evaluation also samples N responses per held-out problem at --temperature and logs eval/pass@k
    for k = 1, 2, 4, ..., N (0: off; N = 8 makes an evaluation about N times as long)"""
    save_every: int = 50
    """save a checkpoint (trained weights, optimizer, random states, step) every this many steps, and when interrupted"""
    resume: bool = False
    """continue the run in --output-dir from its checkpoint, appending to its metrics.jsonl"""
    overwrite: bool = False
    """start afresh in an --output-dir that holds another run, replacing its metrics, samples and checkpoint"""
    gradient_checkpointing: bool = False
    """recompute each layer's activations in the backward pass instead of storing them: less memory, slower steps"""
    fsdp: bool = False
    """under torchrun: shard weights, gradients and optimizer state over the processes (FSDP2) instead of replicating
    them (data parallel); see docs/more-gpus.md"""
    reward_model: str = ""
    """a reward model (saved by reward_model.py, or any decoder sequence-classification model's folder or hub id): its score
    replaces the verifier's in training; the verifier's accuracy is still logged as the gold measure"""
    reward_funcs: tuple[str, ...] = ()
    """reward functions of your own to train on instead, each FILE.py:NAME or MODULE:NAME (or verifier: the task's,
    reward_model: --reward-model's), summed with --reward-weights; see reward_funcs.py"""
    reward_weights: tuple[float, ...] = ()
    """one weight per function of --reward-funcs (default: 1 each)"""

    lora_rank: int = 0
    """train a LoRA adapter of this rank on the frozen weights instead of every weight (0: every weight; needs peft)"""
    lora_alpha: int = 0
    """the adapter's output is scaled by lora_alpha / lora_rank (0: twice the rank, a scale of 2)"""
    lora_target_modules: str = "all-linear"
    """the layers that get an adapter: all-linear (every linear layer but the output layer: the attention and MLP
    projections) or names separated by commas, e.g. q_proj,v_proj"""
    lora_base_dtype: str = "auto"
    """with --lora-rank, the frozen weights' dtype: float32, bfloat16, or auto (bfloat16 on a GPU that supports it)"""
    track: bool = False
    """also log every metric and the evaluation samples to trackio (pip install trackio; `trackio show` to see them)"""
    track_project: str = "tiny-rlhf"
    """the trackio project of --track"""

    # Algorithm specific arguments
    total_steps: int = 0
    """rollout-and-update steps (0: TOTAL_STEPS at the top of this script, half of it on the scratchpad task)"""
    num_prompts: int = 32
    """prompts per rollout"""
    group_size: int = 8
    """responses per prompt (G)"""
    num_minibatches: int = 2
    """minibatches per rollout batch, one optimizer step each"""
    num_epochs: int = 1
    """passes over the rollout batch (mu in the GRPO paper, K epochs in PPO's)"""
    micro_batch_size: int = 0
    """responses per forward/backward pass, for memory (0: the whole minibatch); does not change the gradient"""
    learning_rate: float = 0.0
    """AdamW learning rate (0: 1e-4 for the built-in model, 1e-6 for a pretrained one, whose weights larger steps wreck)"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold"""
    temperature: float = 1.0
    """sampling temperature; log-probs are computed from logits / temperature to match"""
    max_new_tokens: int = 0
    """TOOLS: the budget of a whole conversation after the prompt, the model's tokens and the tools' answers (0: the
    task's own, 32 for multiplication and 64 for products)"""
    max_turns: int = 3
    """TOOLS: the model's turns per conversation at most (a call in the last one goes unanswered)"""
    tool_format: str = "auto"
    """TOOLS: how the model calls the calculator (tools.py): compact (<347*86>), chat (<calc>347 * 86</calc>, answered in
    a tool message), inline ("347 * 86 =" completed in the reply), or auto (chat with a chat template, else compact)"""
    clip_eps: float = 0.2
    """PPO clip range epsilon"""
    beta: float = 0.04
    """coefficient of the KL penalty to the reference model (0: no reference model is loaded)"""

    def __post_init__(self):
        self.output_dir = self.output_dir or f"runs/{self.exp_name}__{self.seed}"
        self.batch_size = self.num_prompts * self.group_size // dist.world_size()  # responses per rollout and process
        self.minibatch_size = self.batch_size // max(1, self.num_minibatches)
        self.micro_batch_size = self.micro_batch_size or self.minibatch_size
        self.learning_rate = self.learning_rate or (1e-4 if self.model_name_or_path == "builtin" else 1e-6)


def check_args(args: Args) -> None:
    """Fail fast with the flag's name, before any expensive work."""
    tasks.check_task_flag(args)
    checks.rl_flags(args)
    checks.flag(args, "group_size", "needs at least 2 responses per prompt to compare", lambda v: v >= 2)
    checks.flag(args, "clip_eps", "must be in (0, 1): the ratio is clipped to [1 - eps, 1 + eps]", lambda v: 0 < v < 1)
    checks.flag(args, "max_turns", "must be at least 1", lambda v: v >= 1)  # TOOLS
    formats = ("auto", "compact", "chat", "inline")
    checks.flag(args, "tool_format", f"allowed values are {', '.join(formats)}", lambda v: v in formats)
    if args.model_name_or_path == "builtin" and not args.dataset:  # TOOLS: the calls are in that task's vocabulary only
        checks.flag(args, "task", "the built-in model calls tools on multiplication only", lambda v: v == "multiplication")
    if args.batch_size % args.num_minibatches or args.minibatch_size % args.micro_batch_size:
        raise SystemExit(
            f"--num-prompts x --group-size ({args.batch_size}) must split into --num-minibatches ({args.num_minibatches}) "
            f"minibatches, and each minibatch ({args.minibatch_size}) into --micro-batch-size ({args.micro_batch_size})"
        )
    checks.output_folders(args)


# ---------------------------------------------------------------------------------------------------------------------
# Algorithm: advantage and loss (pure functions of tensors)
# ---------------------------------------------------------------------------------------------------------------------


def compute_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """A_i = (R_i - mean(R)) / (std(R) + eps) within each group (DeepSeekMath §4.1.2).

    std is the population std (divide by G); eps only guards the division and is unrelated to the clip epsilon.
    rewards: (N,) with each group's G responses contiguous. A group whose rewards are all equal carries no signal:
    its advantage is exactly 0."""
    grouped = rewards.view(-1, group_size)  # (N / G, G)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True, unbiased=False)  # population std: divide by G
    advantages = (grouped - mean) / (std + eps)
    advantages = advantages.masked_fill(grouped.eq(grouped[:, :1]).all(dim=1, keepdim=True), 0.0)
    return advantages.view(-1)  # (N,)


def compute_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, args, num_responses=None):
    """Negative GRPO objective (DeepSeekMath eq. 3) on a batch of responses.

    logprobs, old_logprobs, ref_logprobs, mask: (N, T); advantages: (N,). Per token: the clipped surrogate
    min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) minus beta * k3.
    Reduction: the mean over each response's valid tokens, then the mean over responses.
    With `num_responses` (the minibatch's response count) a micro-batch returns its share of the minibatch's loss,
    so that micro-batches add up to exactly the minibatch's loss and gradient."""
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)  # (N, T) masked before exp: padding cannot overflow
    ratio = torch.exp(log_ratio)  # (N, T) pi_theta / pi_old of each sampled token (PPO, Schulman 2017, §3)
    adv = advantages[:, None]  # (N, 1) the response's advantage is shared by all of its tokens
    low, high = 1 - args.clip_eps, 1 + args.clip_eps  # the clip range of the ratio
    pg_loss = -torch.min(ratio * adv, torch.clamp(ratio, low, high) * adv)  # (N, T)
    loss = pg_loss
    if args.beta > 0:
        # k3 = r - log r - 1, r = pi_ref / pi_theta (DeepSeekMath eq. 4). Its value estimates KL(pi || pi_ref), but at
        # frozen samples its gradient estimates grad KL(pi_ref || pi), the other direction. We keep the paper's term.
        ref_log_ratio = torch.where(mask, ref_logprobs - logprobs, 0.0)  # (N, T) log(pi_ref / pi_theta), masked before exp
        kl = torch.exp(ref_log_ratio) - ref_log_ratio - 1  # (N, T) >= 0
        loss = pg_loss + args.beta * kl
    num_tokens = mask.sum(dim=1).clamp(min=1)  # (N,) |o_i|
    reduce = lambda x: torch.where(mask, x, 0.0).sum(dim=1) / num_tokens  # (N,) 1/|o_i| sum_t x_it, one per response
    total = reduce(loss).sum() / (num_responses or len(loss))  # the mean over responses (or this batch's share of it)

    with torch.no_grad():  # samples, one per valid token or per response, pooled over micro-batches by common.pool_metrics
        metrics = {
            "loss/policy": reduce(pg_loss),
            "train/ratio": ratio[mask],  # logged as its mean, and its min and max (see the log section)
            "train/clip_frac_low": ((ratio < low) & (adv < 0))[mask].float(),
            "train/clip_frac_high": ((ratio > high) & (adv > 0))[mask].float(),
            "kl/old_approx": (torch.exp(log_ratio) - 1 - log_ratio)[mask],  # k3 of KL(pi_old || pi_theta), per token
        }
        if args.beta > 0:
            metrics.update({"kl/ref": kl[mask], "loss/kl": args.beta * reduce(kl)})
    return total, metrics


# ---------------------------------------------------------------------------------------------------------------------
# TOOLS: the multi-turn rollout, and the evaluation and metrics that use it
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Conversations:
    """B conversations after their prompts, as right-padded ids: completion_ids (B, T); by_model (B, T), True on the ids
    the model sampled, the only ones in the loss; valid (B, T), True on every id of the conversation, the environment's
    too, all of them in the context the model reads."""

    completion_ids: torch.Tensor
    by_model: torch.Tensor
    valid: torch.Tensor
    truncated: torch.Tensor  # (B,) out of --max-new-tokens, or a call in the last of --max-turns: no final answer
    final_turns: list[str]  # what the verifier reads: the model's last turn (inline format: the whole reply)
    tool_calls: torch.Tensor  # (B,) calls made
    tool_errors: torch.Tensor  # (B,) calls whose answer was an error
    turns: torch.Tensor  # (B,) the model's turns
    transcripts: list[list[dict]]  # each turn's writer and text, for samples.jsonl


@torch.no_grad()
def rollout(policy, tokenizer, tool_format, prompt_ids, prompt_mask, args, temperature: float) -> Conversations:
    """A round at a time for the whole batch: the model continues every unfinished conversation until EOS, a stop id of
    the call format (tool_format.stop_ids) or the budget; a call is run and its answer's ids appended. A turn of the
    model ends at EOS or at a call; a stop id without a call (an "=" after no arithmetic) does not end it, the model
    goes on with the same turn. The context of a round is the previous context plus the new ids, so the ids already
    sampled never change. Every round writes at least one id to each open conversation: at most --max-new-tokens rounds."""
    B, eos_ids = len(prompt_ids), common.eos_token_ids(policy, tokenizer)
    prompts = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask)]
    written, by_model = [[] for _ in range(B)], [[] for _ in range(B)]  # the ids after each prompt; whether sampled
    transcripts, turn_texts, replies, truncated = [[] for _ in range(B)], [""] * B, [""] * B, [False] * B
    calls, errors, turns = [0] * B, [0] * B, [0] * B
    finished = torch.zeros(B, dtype=torch.bool)
    while not dist.true_on_every_rank(finished.all()):  # under torchrun every rank takes as many rounds as the longest
        # the contexts, left-padded; finished rows ride along as padding, so that every rank runs every forward pass
        contexts = [torch.tensor([p + w]) for p, w in zip(prompts, written)]
        context_ids = common.cat_padded(contexts, tokenizer.pad_token_id, left=True).to(prompt_ids.device)
        context_mask = common.cat_padded([torch.ones_like(c) for c in contexts], 0, left=True).to(prompt_ids.device)
        left = max([args.max_new_tokens - len(w) for w, f in zip(written, finished) if not f], default=0)
        left = int(dist.all_reduce(torch.tensor(left), "max"))  # the same on every rank: they generate in step
        ids, mask, _ = common.generate(
            policy, tokenizer, context_ids, context_mask, left, temperature, tool_format.stop_ids, finished
        )  # (B, t) this round's ids, through each row's first EOS or stop id
        for i in torch.nonzero(~finished).flatten().tolist():
            sampled = ids[i][mask[i]].tolist()[: args.max_new_tokens - len(written[i])]  # within the whole budget
            written[i], by_model[i] = written[i] + sampled, by_model[i] + [True] * len(sampled)
            ended_by_eos = sampled[-1] in eos_ids
            text = tokenizer.decode(sampled[:-1] if ended_by_eos else sampled)  # without its EOS
            turn_texts[i], replies[i] = turn_texts[i] + text, replies[i] + text
            transcripts[i].append({"model": tokenizer.decode(sampled)})  # this round's ids (a turn has one or more)
            # a call is read where the format answers one: after a call's stop id, or the template's end-of-turn token;
            # at a stop without a call, the same turn goes on in the next round
            call = tool_format.find_call(turn_texts[i]) if sampled[-1] in tool_format.call_ends else None
            out_of_room = len(written[i]) == args.max_new_tokens
            if call is None and (ended_by_eos or out_of_room):  # the model answered, or the budget cut it off
                finished[i], truncated[i], turns[i] = True, not ended_by_eos, turns[i] + 1
            elif call is not None and (turns[i] + 1 == args.max_turns or out_of_room):  # no turn or room for an answer
                finished[i], truncated[i], turns[i] = True, True, turns[i] + 1
            elif call is not None:  # run the tool (never raises: failures come back as text) and append its answer's ids
                result, failed = tools.run_tool(tools.TOOLS, *call)
                calls[i], errors[i], turns[i] = calls[i] + 1, errors[i] + failed, turns[i] + 1
                answer = tool_format.result_ids(result)[: args.max_new_tokens - len(written[i])]
                written[i], by_model[i] = written[i] + answer, by_model[i] + [False] * len(answer)
                transcripts[i].append({"tool": tokenizer.decode(answer)})
                turn_texts[i], replies[i] = "", replies[i] + tokenizer.decode(answer)
                finished[i] = truncated[i] = len(written[i]) >= args.max_new_tokens
    final_turns = replies if tool_format.inline else turn_texts  # inline: the whole reply, the tool's results included
    as_tensor = lambda rows, pad: common.cat_padded([torch.tensor([r]) for r in rows], pad).to(prompt_ids.device)  # (B, T)
    return Conversations(
        completion_ids=as_tensor(written, tokenizer.pad_token_id),
        by_model=as_tensor(by_model, False),
        valid=as_tensor([[True] * len(w) for w in written], False),
        truncated=torch.tensor(truncated, device=prompt_ids.device),
        final_turns=final_turns,
        tool_calls=torch.tensor(calls, device=prompt_ids.device),
        tool_errors=torch.tensor(errors, device=prompt_ids.device),
        turns=torch.tensor(turns, device=prompt_ids.device),
        transcripts=transcripts,
    )


def tool_metrics(conversations: Conversations, correct: torch.Tensor, prefix: str) -> dict:
    """One sample per conversation, pooled by common.pool_metrics: tool calls, tool errors, the model's turns, the share
    of conversations that called a tool, accuracy with and without a call, tokens written by the model and by the
    environment."""
    called = conversations.tool_calls > 0
    metrics = {
        f"{prefix}/tool_calls": conversations.tool_calls.float(),
        f"{prefix}/tool_errors": conversations.tool_errors.float(),
        f"{prefix}/turns": conversations.turns.float(),
        f"{prefix}/called_tool_frac": called.float(),
        f"{prefix}/tokens_by_model": conversations.by_model.sum(dim=1).float(),
        f"{prefix}/tokens_by_environment": (conversations.valid & ~conversations.by_model).sum(dim=1).float(),
    }
    if called.any():
        metrics[f"{prefix}/accuracy_with_call"] = correct[called].float()
    if (~called).any():
        metrics[f"{prefix}/accuracy_without_call"] = correct[~called].float()
    return metrics


def evaluate(policy, tokenizer, tool_format, task, args, num_samples: int = 4, batch_size: int = 512) -> dict:
    """common.evaluate with tools: greedy conversations on the held-out split, `batch_size` at a time (under torchrun
    each rank takes a share, in as many batches as every other rank), their accuracy and tool metrics, and every turn of
    the first `num_samples` of them for samples.jsonl. With --eval-samples N, pass@k of whole conversations, N per
    problem at --temperature, about `batch_size` conversations at a time (see common.sampled_pass_at_k)."""
    device = next(policy.parameters()).device
    rows = torch.arange(len(task.eval)).tensor_split(dist.world_size())[dist.rank()]  # under torchrun: this rank's share
    per_batch = {"greedy": batch_size, "sampled": max(1, batch_size // max(1, args.eval_samples))}  # problems per batch
    metrics, samples, pass_samples = [], [], []
    num_batches = math.ceil(math.ceil(len(task.eval) / dist.world_size()) / per_batch["greedy"])  # the same on every rank
    for part in rows.tensor_split(num_batches):
        batch = task.eval[part.tolist()]
        prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, batch["prompt"], device)
        conversations = rollout(policy, tokenizer, tool_format, prompt_ids, prompt_mask, args, temperature=0.0)
        correct = task.verify(conversations.final_turns, batch["answer"]).to(device)
        metrics.append({"eval/accuracy": correct, **tool_metrics(conversations, correct, "eval")})
        fields = zip(batch["prompt"], conversations.transcripts, batch["answer"], correct.tolist())
        samples += [{"prompt": p, "turns": t, "answer": a, "reward": r} for p, t, a, r in fields][: num_samples - len(samples)]
    if args.eval_samples:  # pass@k of whole conversations, args.eval_samples per problem at --temperature (see common)
        n = args.eval_samples
        num_batches = math.ceil(math.ceil(len(task.eval) / dist.world_size()) / per_batch["sampled"])
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(dist.rank())  # every evaluation draws the same random numbers, training's stay untouched
            for part in rows.tensor_split(num_batches):
                batch = task.eval[part.tolist()]
                prompts, answers = (
                    [p for p in batch["prompt"] for _ in range(n)],
                    [a for a in batch["answer"] for _ in range(n)],
                )
                prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, prompts, device)  # each problem's n contiguous
                sampled = rollout(policy, tokenizer, tool_format, prompt_ids, prompt_mask, args, args.temperature)
                num_correct = task.verify(sampled.final_turns, answers).view(-1, n).sum(dim=1)
                pass_samples.append(common.pass_at_k_samples(num_correct, n))
    return {**common.pool_metrics(metrics + pass_samples), "samples": samples}


# ---------------------------------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------------------------------

if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args)
    device = dist.init_device(args.device)  # auto: CUDA when available; under torchrun, this process's own device
    common.seed_everything(args.seed + dist.rank())  # under torchrun each process samples its own responses
    task = tasks.make_task(args.task, args.dataset, args.num_eval, args.prompt_column, args.answer_column)
    args.max_new_tokens = args.max_new_tokens or task.max_new_tokens  # the task's budget unless --max-new-tokens
    args.total_steps = args.total_steps or (TOTAL_STEPS // 2 if args.task == "scratchpad" else TOTAL_STEPS)
    checks.split_sizes(args, task)  # enough training prompts for a step, and held-out ones for every process
    tokenizer = models.load_tokenizer(args.model_name_or_path, args.cache_dir, args.task)
    policy = models.load_model(
        args.model_name_or_path, args.cache_dir, device, args.task, lora.base_dtype(args, device)
    )  # float32, or with --lora-rank the frozen weights in --lora-base-dtype
    # TOOLS: the prompts are rendered after the model loads, since its EOS ids are where a turn stops: a chat model calls
    # in its turns and hears back in tool messages (or inline), the built-in model writes <...>; the call format's
    # instruction joins the task's in the system message, unless the template describes the calculator itself
    tool_format, task = tools.format_and_prompts(args, task, tokenizer, common.eos_token_ids(policy, tokenizer))
    if args.gradient_checkpointing:
        models.enable_gradient_checkpointing(policy)
    if args.lora_rank:  # train a low-rank adapter on the frozen weights instead of every weight
        policy = lora.add_adapter(policy, args)
    ref_policy = None  # the frozen warm-up policy, only needed for the KL penalty
    if args.beta > 0 and args.lora_rank:  # the policy with its adapter switched off: no second copy of the weights
        ref_policy = lora.WithoutAdapter(policy)
    elif args.beta > 0:
        ref_policy, _ = models.load_model_and_tokenizer(args.model_name_or_path, args.cache_dir, device, args.task)
        ref_policy.requires_grad_(False)
    reward_functions = reward_funcs.RewardFunctions(args, task, tokenizer, device)  # the verifier, or --reward-funcs
    policy, ref_policy = dist.prepare_models(args, policy, ref_policy)  # torchrun: rank 0's weights everywhere, or FSDP2
    # models stay in eval mode throughout: no dropout, so that on-policy the ratio is exactly 1
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=0.0)
    rng = random.Random(args.seed)
    checkpoint = run_state.Checkpoint(args, optimizer, rng)  # with --resume: the weights, optimizer, RNGs and step saved last
    # with --resume: appends after that step; under torchrun, pools every row over the processes
    logger = run_state.MetricsLogger(args.output_dir, checkpoint.resumed_step, common.pool_metrics)
    if args.track:  # every logged row to trackio too, with the flags as the run's config
        logger.track(vars(args))
    eval_metrics = logger.last_eval or evaluate(policy, tokenizer, tool_format, task, args)  # TOOLS
    logger.log(0, eval_metrics)

    bar = tqdm(range(checkpoint.step + 1, args.total_steps + 1), args.exp_name, disable=not dist.is_main())
    for step in bar:
        # -------------------------------------------------------------------------------------------------------------
        # Rollout: G conversations per prompt from the frozen behaviour policy pi_old, the tools answering its calls
        # -------------------------------------------------------------------------------------------------------------
        step_start = time.time()
        batch = task.train[dist.shard(rng.sample(range(len(task.train)), args.num_prompts))]
        prompts = [p for p in batch["prompt"] for _ in range(args.group_size)]  # each group is contiguous
        answers = [a for a in batch["answer"] for _ in range(args.group_size)]
        prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, prompts, device)  # (B, P)
        conversations = rollout(policy, tokenizer, tool_format, prompt_ids, prompt_mask, args, args.temperature)
        completion_ids, truncated = conversations.completion_ids, conversations.truncated  # (B, T), (B,)  # TOOLS
        mask = conversations.by_model  # (B, T)  # TOOLS: the loss mask: only the ids the model sampled
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, conversations.valid.long()], dim=1)  # TOOLS: the context: every id
        by_environment = conversations.valid & ~conversations.by_model  # (B, T)  # TOOLS: the tools' answers
        T = completion_ids.shape[1]
        # with one optimizer step per rollout the policy is still pi_old when the loss is computed: the old log-probs
        # are then the current ones detached, and a separate forward pass would be wasted work
        on_policy = args.num_minibatches == 1 and args.num_epochs == 1
        old_logprobs, ref_logprobs = None, None  # (B, T) each, no gradient
        if not on_policy:
            old_logprobs = common.logprobs_no_grad(
                policy, input_ids, attention_mask, T, args.temperature, args.micro_batch_size
            )
        if args.beta > 0:
            ref_logprobs = common.logprobs_no_grad(
                ref_policy, input_ids, attention_mask, T, args.temperature, args.micro_batch_size
            )

        # -------------------------------------------------------------------------------------------------------------
        # Reward: the task's verifier on the model's last turn (TOOLS), 1 for a correct final answer, or
        # --reward-model's score, or --reward-funcs' weighted sum; the verifier then stays the gold measure, logged only
        # -------------------------------------------------------------------------------------------------------------
        completions = conversations.final_turns  # (B,) texts  # TOOLS: the model's last turn
        gold = task.verify(completions, answers).to(device)  # (B,) 1 correct, 0 wrong
        rewards, reward_scores = reward_functions(batch, completions, gold, input_ids, attention_mask)  # (B,), (B, F)

        # -------------------------------------------------------------------------------------------------------------
        # Advantage: each response compared with its group
        # -------------------------------------------------------------------------------------------------------------
        advantages = compute_advantages(rewards, args.group_size)  # (B,)
        rollout_time = time.time() - step_start

        # -------------------------------------------------------------------------------------------------------------
        # Update: num_epochs passes over num_minibatches minibatches, one optimizer step each
        # -------------------------------------------------------------------------------------------------------------
        train_metrics = []
        for _ in range(args.num_epochs):
            for mb_idx in torch.randperm(args.batch_size, device=device).split(args.minibatch_size):
                optimizer.zero_grad()
                for idx in mb_idx.split(args.micro_batch_size):
                    logprobs, entropy = common.completion_logprobs(
                        policy, input_ids[idx], attention_mask[idx], T, args.temperature
                    )  # (b, T) each
                    micro_old_logprobs = logprobs.detach() if on_policy else old_logprobs[idx]
                    micro_ref_logprobs = ref_logprobs[idx] if args.beta > 0 else None
                    loss, metrics = compute_loss(
                        logprobs, micro_old_logprobs, micro_ref_logprobs, advantages[idx], mask[idx], args, len(mb_idx)
                    )
                    common.check_finite(loss, "loss", step)
                    loss.backward()
                    metrics["train/entropy"] = entropy[mask[idx]]
                    # TOOLS: how likely the model finds the tools' answers, as if it wrote them (a probe, not trained)
                    metrics["train/environment_logprob"] = logprobs.detach()[by_environment[idx]]
                    train_metrics.append(metrics)
                dist.average_gradients(optimizer)  # under torchrun: every gradient becomes its mean over the processes
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                common.check_finite(grad_norm, "gradient norm", step)
                optimizer.step()
                train_metrics.append({"train/grad_norm": grad_norm})

        # -------------------------------------------------------------------------------------------------------------
        # Log and evaluate
        # -------------------------------------------------------------------------------------------------------------
        grouped = gold.view(-1, args.group_size)  # outcomes
        row = common.pool_metrics(train_metrics, min_max=("train/ratio",))  # means over tokens or responses
        row.update(
            {
                "rollout/reward_mean": rewards.mean(),
                **reward_functions.metrics(reward_scores),  # reward/NAME of --reward-funcs
                "rollout/gold_accuracy": gold.mean(),
                "rollout/all_correct_frac": (grouped == 1).all(dim=1).float().mean(),
                "rollout/all_wrong_frac": (grouped == 0).all(dim=1).float().mean(),
                "rollout/response_length": mask.sum(dim=1).float().mean(),
                **common.lengths_by_outcome(mask.sum(dim=1), gold),
                "rollout/truncated_frac": truncated.float().mean(),
                "time/rollout": rollout_time,
                "time/step": time.time() - step_start,
                "train/responses": step * args.num_prompts * args.group_size,
            }
        )
        row.update(common.pool_metrics([tool_metrics(conversations, gold, "rollout")]))  # TOOLS
        if step % args.eval_every == 0 or step == args.total_steps:
            eval_metrics = evaluate(policy, tokenizer, tool_format, task, args)  # TOOLS
            row.update(eval_metrics)
        logger.log(step, row)
        bar.set_postfix(reward=f"{rewards.mean().item():.2f}", eval_accuracy=f"{eval_metrics['eval/accuracy']:.2f}")
        checkpoint.step_done(step)  # saves every --save-every steps; after Ctrl-C or SIGTERM, saves and exits

    # -----------------------------------------------------------------------------------------------------------------
    # Save
    # -----------------------------------------------------------------------------------------------------------------
    dist.save_model(policy, tokenizer, os.path.join(args.output_dir, "model"))  # under torchrun: rank 0, gathered
    logger.close()
    checkpoint.close()
    print(f"eval/accuracy {eval_metrics['eval/accuracy']:.3f} after {args.total_steps} steps; saved to {args.output_dir}")
