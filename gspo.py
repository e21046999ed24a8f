"""GSPO: group sequence policy optimisation (Zheng et al. 2025, Group Sequence Policy Optimization, §4).

GRPO's advantages with one importance ratio per response instead of one per token: the sequence ratio
q_i = exp(mean_t (log pi - log pi_old)) = W_i^(1/|o_i|), the geometric mean of the token ratios, shared by every token
of the response and clipped once, with tiny ranges (3e-4, 4e-4). q_i is not the sequence's true ratio W_i.

    python gspo.py

Departures from the paper:
1. The reward is a verifier (1 correct, 0 wrong) unless --reward-model or --reward-funcs say, and the reference model is the
   warm-up policy, never reset.
2. The group std is the population std (divide by G); most libraries use the sample std (G - 1).
3. A group whose rewards are all equal gets an advantage of exactly 0 (never NaN).
4. No KL term by default. With a single on-policy step per rollout q_i = 1 and GSPO coincides with GRPO, so each
   rollout batch is split into 4 minibatches by default, for num_epochs passes; gradients are clipped.
"""

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
from plumbing import checks, dist, lora, models, run_state

TOTAL_STEPS = 200  # default --total-steps; halved on the scratchpad task, whose steps cost about four times as much


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
    task: str = "addition"
    """'addition' or 'scratchpad' (offline, for the built-in model), 'sums' (offline, for a chat model) or 'gsm8k' (hub)"""
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
    --dataset prompts scored like gsm8k, "Solve the problem step by step. End your reply with ... a plain number.")"""
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
    num_minibatches: int = 4  # GSPO: several updates per rollout, so that the sequence ratios depart from 1
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
    """generation budget per response (0: the task's own, 8 for addition and 64 for scratchpad)"""
    clip_eps_low: float = 3e-4  # GSPO: sequence-level clip ranges
    """lower clip range of the sequence ratio"""
    clip_eps_high: float = 4e-4
    """upper clip range of the sequence ratio"""
    beta: float = 0.0  # GSPO: no KL term
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
    for flag in ("clip_eps_low", "clip_eps_high"):
        checks.flag(args, flag, "must be in (0, 1): the clip range is [1 - eps_low, 1 + eps_high]", lambda v: 0 < v < 1)
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
    """Negative GSPO objective (GSPO eq. 5-7) on a batch of responses.

    logprobs, old_logprobs, ref_logprobs, mask: (N, T); advantages: (N,). Per response: the clipped surrogate
    min(q * A, clip(q, 1 - eps_low, 1 + eps_high) * A) with the sequence ratio q, on every token, minus beta * k3.
    Reduction: the mean over each response's valid tokens, then the mean over responses.
    With `num_responses` (the minibatch's response count) a micro-batch returns its share of the minibatch's loss,
    so that micro-batches add up to exactly the minibatch's loss and gradient."""
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)  # (N, T) masked before exp: padding cannot overflow
    seq_log_ratio = log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # (N, 1) GSPO: log q_i
    ratio = torch.exp(seq_log_ratio).expand_as(logprobs)  # (N, T) GSPO: q_i on every token; its gradient reaches all of them
    adv = advantages[:, None]  # (N, 1) the response's advantage is shared by all of its tokens
    low, high = 1 - args.clip_eps_low, 1 + args.clip_eps_high  # the clip range of the ratio; GSPO: tiny, sequence-level
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
    # the tokenizer first, alone: the prompts are rendered (and a bad one refused) before any weights load
    tokenizer = models.load_tokenizer(args.model_name_or_path, args.cache_dir, args.task)
    task = tasks.apply_chat_template(task, tokenizer, args.chat_template, args.instruction)  # as the model reads it
    policy = models.load_model(
        args.model_name_or_path, args.cache_dir, device, args.task, lora.base_dtype(args, device)
    )  # float32, or with --lora-rank the frozen weights in --lora-base-dtype
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
    eval_metrics = logger.last_eval or common.evaluate(
        policy, tokenizer, task, args.max_new_tokens, args.eval_samples, args.temperature
    )
    logger.log(0, eval_metrics)

    bar = tqdm(range(checkpoint.step + 1, args.total_steps + 1), args.exp_name, disable=not dist.is_main())
    for step in bar:
        # -------------------------------------------------------------------------------------------------------------
        # Rollout: G responses per prompt from the frozen behaviour policy pi_old
        # -------------------------------------------------------------------------------------------------------------
        step_start = time.time()
        batch = task.train[dist.shard(rng.sample(range(len(task.train)), args.num_prompts))]
        prompts = [p for p in batch["prompt"] for _ in range(args.group_size)]  # each group is contiguous
        answers = [a for a in batch["answer"] for _ in range(args.group_size)]
        prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, prompts, device)  # (B, P)
        completion_ids, mask, truncated = common.generate(
            policy, tokenizer, prompt_ids, prompt_mask, args.max_new_tokens, args.temperature
        )  # (B, T), (B, T) through the first EOS, (B,)
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)
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
        # Reward: the task's verifier, 1 for a correct final answer (truncated responses are scored as they stand), or
        # --reward-model's score, or --reward-funcs' weighted sum; the verifier then stays the gold measure, logged only
        # -------------------------------------------------------------------------------------------------------------
        completions = common.decode(tokenizer, completion_ids, mask, truncated)  # (B,) texts
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
        if step % args.eval_every == 0 or step == args.total_steps:
            eval_metrics = common.evaluate(policy, tokenizer, task, args.max_new_tokens, args.eval_samples, args.temperature)
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
